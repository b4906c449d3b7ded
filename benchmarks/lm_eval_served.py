r"""lm-evaluation-harness against our server: its accuracy on a local task equals our own teacher-forced scoring.

The tiny model (random init, tests/data/tokenizer.json) served in-process (the real engine, engine thread
and app on a free localhost port); `lm_eval --model local-completions` (tokenizer_backend=remote: it
tokenizes through /tokenize and /detokenize, found by /tokenizer_info, so it loads nothing) runs the
tasks of tests/data/lm_eval (tiny_mc: multiple choice by loglikelihood; tiny_gen: generate_until); then
the same multiple-choice items are scored here by the training model's teacher-forced log-softmax,
tokenized as lm-eval does (continuation = tokens of context + " " + choice past the context's).

    pip install lm-eval==0.4.13 tenacity    # not in requirements.txt: nothing in CI runs it
    PYTHONPATH=. .venv/bin/python benchmarks/lm_eval_served.py

Prints a table (per task: lm-eval's metric, ours) and one JSON line. Run from the repository root.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import numpy as np

from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.protocol import Texts, load_chat_template
from tests.server_harness import serving

TASKS = "tests/data/lm_eval"
TOKENIZER = "tests/data/tokenizer.json"
SIZES = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
             serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=32, prefill_chunk_size=8,
             serve_width_buckets=1, serve_context_buckets=1, tokenizer_type="hf", tokenizer_path=TOKENIZER)


def ours(cfg, graphdef, params, buffers, tok, docs) -> tuple[list[float], list[list[float]]]:
  """Per item: 1.0 when the answer's choice has the highest teacher-forced loglikelihood; every choice's."""
  fwd = jax.jit(lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0])  # [1,T,V]
  hits, logliks = [], []
  for d in docs:
    scores = []
    for choice in d["choices"]:
      ctx, whole = tok.encode(d["question"]), tok.encode(d["question"] + " " + choice)  # lm-eval's delimiter " "
      lsm = np.asarray(jax.nn.log_softmax(fwd(params, buffers, np.asarray([whole], np.int32))[0], axis=-1))  # [T,V]
      scores.append(float(sum(lsm[i - 1, whole[i]] for i in range(len(ctx), len(whole)))))
    hits.append(float(int(np.argmax(scores)) == d["answer"]))
    logliks.append(scores)
  return hits, logliks


def main() -> None:
  cfg = pyconfig.initialize(["lm_eval_served", "base.yml"], num_devices=1, ici_data_parallelism=1, **SIZES)
  tok = load_tokenizer(cfg)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  engine = ServingEngine(cfg, graphdef, params, buffers, sample_vocab=tok.vocab_size, eos_id=tok.eos_id)
  thread = EngineThread(lambda: contextlib.nullcontext(engine), max_waiting=64, log=print)
  _, _, special = load_chat_template("", TOKENIZER)
  texts = Texts(tok, add_bos=False, vocab_size=cfg.vocab_size, chat_template=None, chat_template_source="none",
                special_tokens=special)
  out = tempfile.mkdtemp(prefix="lm_eval_served_")
  with serving(build_app(Server(cfg, texts, thread, "tiny"))) as (url, _):
    while httpx.get(url + "/health").status_code != 200:
      time.sleep(0.5)
    args = (f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=remote,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--tasks", "tiny_mc,tiny_gen", "--include_path", TASKS, "--output_path", out,
                          "--log_samples"], env=env, capture_output=True, text=True)
  if run.returncode:
    sys.exit(f"lm_eval failed (exit {run.returncode}); is lm-eval installed? its last lines:\n{run.stderr[-2000:]}")
  samples = [json.loads(line) for line in open(glob.glob(f"{out}/**/samples_tiny_mc_*.jsonl", recursive=True)[0])]
  samples.sort(key=lambda s: s["doc_id"])
  hits, logliks = ours(cfg, graphdef, params, buffers, tok, [s["doc"] for s in samples])
  theirs = [float(s["acc"]) for s in samples]
  gap = max(abs(a - float(b[0])) for s, ls in zip(samples, logliks) for a, b in zip(ls, s["filtered_resps"]))
  gen = [json.loads(line) for line in open(glob.glob(f"{out}/**/samples_tiny_gen_*.jsonl", recursive=True)[0])]
  print(f"{'task':10s} {'metric':12s} {'lm-eval':>8s} {'ours':>8s}")
  print(f"{'tiny_mc':10s} {'acc':12s} {np.mean(theirs):8.3f} {np.mean(hits):8.3f}")
  print(f"{'tiny_gen':10s} {'exact_match':12s} {np.mean([s['exact_match'] for s in gen]):8.3f} {'':>8s}")
  print(f"items scored alike: {theirs == hits}; max |loglikelihood lm-eval - ours| = {gap:.2e}")
  print(json.dumps({"benchmark": "lm_eval_served", "lm_eval_acc": float(np.mean(theirs)), "our_acc": float(np.mean(hits)),
                    "items_equal": theirs == hits, "max_loglik_gap": gap, "items": len(samples)}))


if __name__ == "__main__":
  main()
