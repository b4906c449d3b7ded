r"""lm-evaluation-harness against our server: its accuracy on a local task equals our own teacher-forced scoring.

The tiny model (random init, tests/data/tokenizer.json) served in-process (the real engine, engine thread
and app on a free localhost port); lm-eval's `local-completions` model (tokenizer_backend=remote: it
tokenizes through /tokenize and /detokenize, found by /tokenizer_info, so it loads nothing) runs the
tasks of tests/data/lm_eval (tiny_mc: multiple choice by loglikelihood; tiny_gen: generate_until) in this
process; then the same items are scored by the training model's teacher-forced log-softmax and its greedy
continuation (MaxText/server/lm_eval_client.py, which tests/integration/test_server.py runs in CI). Anything
trying to reach past 127.0.0.1 meanwhile is refused and counted.

    PYTHONPATH=. .venv/bin/python benchmarks/lm_eval_served.py     # lm_eval==0.4.13 is in requirements.txt

Prints a table (per task: lm-eval's metric, ours) and one JSON line. Run from the repository root.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import numpy as np

from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.in_process import serve_in_thread
from MaxText.server.lm_eval_client import Teacher, loopback_only, run_lm_eval
from MaxText.server.protocol import Texts, load_chat_template

TOKENIZER = "tests/data/tokenizer.json"
SIZES = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
             serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=32, prefill_chunk_size=8,
             serve_width_buckets=1, serve_context_buckets=1, tokenizer_type="hf", tokenizer_path=TOKENIZER)


def main() -> None:
  cfg = pyconfig.initialize(["lm_eval_served", "base.yml"], num_devices=1, ici_data_parallelism=1, **SIZES)
  tok = load_tokenizer(cfg)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  engine = ServingEngine(cfg, graphdef, params, buffers, sample_vocab=tok.vocab_size, eos_id=tok.eos_id)
  thread = EngineThread(lambda: contextlib.nullcontext(engine), max_waiting=64, log=print)
  _, _, special = load_chat_template("", TOKENIZER)
  texts = Texts(tok, add_bos=False, vocab_size=cfg.vocab_size, chat_template=None, chat_template_source="none",
                special_tokens=special)
  with serve_in_thread(build_app(Server(cfg, texts, thread, "tiny"))) as (url, _):
    while httpx.get(url + "/health").status_code != 200:
      time.sleep(0.5)
    t0 = time.perf_counter()
    with loopback_only() as tried:
      samples = run_lm_eval(url, "tiny")
    lm_eval_s = time.perf_counter() - t0
  teacher = Teacher(graphdef, params, buffers, tok, cfg.max_target_length)
  mc, gen = samples["tiny_mc"], samples["tiny_gen"]
  logliks = [teacher.choices(s["doc"]) for s in mc]
  hits = [float(int(np.argmax(ls)) == s["doc"]["answer"]) for s, ls in zip(mc, logliks)]
  theirs = [float(s["acc"]) for s in mc]
  gap = max(abs(a - float(b[0])) for s, ls in zip(mc, logliks) for a, b in zip(ls, s["filtered_resps"]))
  greedy_equal = [s["filtered_resps"][0] for s in gen] == [teacher.greedy(s["doc"]["question"]) for s in gen]
  print(f"{'task':10s} {'metric':12s} {'lm-eval':>8s} {'ours':>8s}")
  print(f"{'tiny_mc':10s} {'acc':12s} {np.mean(theirs):8.3f} {np.mean(hits):8.3f}")
  print(f"{'tiny_gen':10s} {'exact_match':12s} {np.mean([s['exact_match'] for s in gen]):8.3f} {'':>8s}")
  print(f"items scored alike: {theirs == hits}; max |loglikelihood lm-eval - ours| = {gap:.2e}; generate_until = "
        f"our greedy: {greedy_equal}; lm-eval ran {lm_eval_s:.1f} s; reached past 127.0.0.1: {tried}")
  print(json.dumps({"benchmark": "lm_eval_served", "lm_eval_acc": float(np.mean(theirs)), "our_acc": float(np.mean(hits)),
                    "items_equal": theirs == hits, "max_loglik_gap": gap, "greedy_equal": greedy_equal,
                    "items": len(mc), "lm_eval_s": round(lm_eval_s, 1), "network_attempts": len(tried)}))


if __name__ == "__main__":
  main()
