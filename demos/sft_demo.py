r"""The SFT demo, end to end: synthetic conversations -> train.py use_sft=true -> python -m MaxText.serve
-> held-out conversations scored through /v1/chat/completions with the openai client, before and
after SFT.

    PYTHONPATH=. .venv/bin/python demos/sft_demo.py --work /tmp/sft_demo [--quick] [--steps 600 ...] [key=value ...]
    PYTHONPATH=. .venv/bin/python demos/sft_demo.py --work /tmp/t52sft lora_rank=16   # --base trained --width wide

1. demos/sft_conversations.py writes <work>/data/{train,eval}.jsonl (single-digit additions with a
   one-line thinking trace; 15% of the training set, 30% of the held-out one, where the assistant calls
   the `add` tool, gets its result and answers: the arithmetic is what takes steps to learn, the call
   is a copy of the operands, learned from fewer).
2. --tokenizer bpe (the default): demos/sft_tokenizer.py trains a byte-level BPE tokenizer on the
   training conversations as V3.2's format renders them (the 7 markers one token each, digits one
   token each) into <work>/tokenizer.json; the model's vocab_size is its size rounded up to 128.
   Why: with the byte-level test tokenizer the format's tools block alone is ~800 tokens, so a tool
   conversation fills a 1088-token row by itself; with the BPE one it is ~160 tokens and a row of 256
   holds a few conversations: ~6x fewer tokens to train on.
3. train.py trains the tiny model (configs/base.yml, model deepseek3.2-tiny, from its random init or the base,
   seed fixed) with use_sft=true for --steps steps into <work>/sft; extra key=value go to train and serve
   after DEFAULT_KEYS (no MTP, no remat, use_indexer=false: dense MLA, about 2x faster a step on
   the CPU than the lightning indexer's sparse training at these lengths, with the same loss after
   150 steps; what the demo shows is SFT, not DSA: pass key=value to train with the indexer).
4. The server starts twice on a free 127.0.0.1 port from the run's config.yml: as it is (what SFT
   started from: the random init, or the base of --base trained; "before") and with <work>/sft/checkpoints ("after");
   both share a JAX compilation cache under <work>, so the second start reads the programs back.
5. Each held-out conversation's first user turn is sent (temperature 0, thinking on, the record's
   tools): exact match = the reply's content is the sum; tool accuracy = a tool conversation's reply
   has parsed tool_calls calling add with {"a": a, "b": b}.

--base trained (the default with lora_rank) first trains a base model, every weight from the random init, on a
related task in the same format (sft_conversations.py --ops '*-': products and differences of the same digits,
a share of the products calling a `mul` tool) for --base_steps steps into <work>/base (cached: a later run with
the same base command, tokenizer and data reuses it), and the SFT run starts from it (load_parameters_path):
the base knows the chat format, the digits, the thinking trace and the DSML tool-call syntax, but not
additions nor the `add` tool ("before" serves it). --width wide (the default with lora_rank) adds WIDE_KEYS.

With lora_rank=R (> 0) among the keys (LoRA, docs/lora.md) train.py trains rank-R adapters over the frozen
base (lora_module_path: the default modules unless given; learning rate LEARNING_RATE["lora"] unless given),
"before" serves the base, and "after" serves the run's adapters merged into it (hf_export.restore_parameters,
saved as <work>/merged; both with lora_rank=0). The JSON line then also gives the checkpointed train state's
bytes (trained parameters + buffers + AdamW moments) of the LoRA run and of the full fine-tune of the same
model, and their ratio.

Prints a table and one JSON line (exact_match_before, exact_match_after, tool_call_accuracy, ...).
Each SFT row holds whole conversations: --max_target_length must hold a tool conversation (~160
tokens with the BPE tokenizer, ~1050 with tests/data/tokenizer.json: then pass --max_target_length 1088).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import sys
import time

from benchmarks.serve_load import REPO, started
from demos.sft_conversations import add_arguments, write_sets
from demos.sft_tokenizer import rendered, train_tokenizer

# The model keys when none are given: the tiny model with dense attention (see the module docstring).
DEFAULT_KEYS = ("mtp_num_layers=0", "remat_policy=none", "use_indexer=false")
# --width wide: the tiny model widened so that rank-16 adapters on the default modules, with their AdamW moments,
# are 4.1% of the full fine-tune's checkpointed state (sft_demo.checkpoint_bytes; the tiny model's widths are 32 to
# 128, where r = 16 is an eighth to a half of a side: 16.1%), in 2 layers (one dense, one MoE) to keep a step's CPU
# time near 4x the tiny model's.
WIDE_KEYS = ("emb_dim=256", "mlp_dim=1024", "q_lora_rank=128", "kv_lora_rank=128", "moe_mlp_dim=256",
             "num_decoder_layers=2")
# --base trained: the base's task (sft_conversations.py flags): products and differences, 30% of the products
# calling `mul` (15% of the set): the format and the tool-call syntax, neither additions nor the `add` tool.
BASE_OPS, BASE_TASK = "*-", {"tool_share": 0.3, "eval_tool_share": 0.3}
LORA_KEYS = ("lora_rank=", "lora_alpha=", "lora_module_path=")  # the adapters' keys: never the base's
QUICK = {"steps": 400, "score": 40}  # --quick
LEARNING_RATE = {"full": 3e-3, "lora": 1e-2}  # --learning_rate's default: LoRA's B starts at 0 and moves ~lr a step
STEPS = {"full": 600, "lora": 300}  # --steps' default: the full fine-tune from the random init; LoRA over the base


def run(cmd: list[str], env: dict, log_path: str) -> None:
  import subprocess
  with open(log_path, "w") as log:
    rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  if rc:
    raise SystemExit(f"error: {' '.join(cmd[:3])} exited {rc}; see {log_path}")


def demo_tokenizer(args, *data: str) -> tuple[str, int]:
  """(tokenizer.json path, the model's vocab_size: the tokenizer's rounded up to 128). --tokenizer bpe trains
  one on the training conversations of every `data` folder into <work>/tokenizer.json (sft_tokenizer.py)."""
  from MaxText.data.tokenizer import load_tokenizer
  path = args.tokenizer
  if path == "bpe":
    def records():
      for folder in data:
        with open(os.path.join(folder, "train.jsonl")) as f:
          yield from (json.loads(line) for line in f)
    path = train_tokenizer(rendered(records()), os.path.join(args.work, "tokenizer.json"), vocab_size=1024)
  size = load_tokenizer(tokenizer_type="hf", tokenizer_path=path).vocab_size
  return os.path.abspath(path), max(512, -(-size // 128) * 128)


def train_command(args, data: str, tokenizer: str, vocab_size: int, extra: list[str], run_name: str = "sft") -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", "use_sft=true", "train_data_columns=[messages]",
          "dataset_type=file", f"dataset_path={data}/train.jsonl", "tokenizer_type=hf", f"tokenizer_path={tokenizer}",
          f"vocab_size={vocab_size}",
          f"max_target_length={args.max_target_length}", f"max_prefill_length={args.max_target_length}",
          f"global_batch_size={args.batch}", f"steps={args.steps}", f"learning_rate={args.learning_rate}",
          f"warmup_steps={max(1, args.steps // 20)}", f"checkpoint_period={args.steps}", "log_period=10",
          "async_checkpointing=false", f"base_output_directory={args.work}", f"run_name={run_name}", *extra]


def score(url: str, model: str, records: list[dict], max_tokens: int, workers: int) -> list[dict]:
  """Per record: {tool, exact, call_ok} from its first user turn's reply."""
  from openai import OpenAI
  client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)

  def one(record: dict) -> dict:
    user = record["messages"][0]
    a, b = (int(x) for x in re.match(r"(\d+)\+(\d+)=\?", user["content"]).groups())
    tools = record.get("tools")
    kw = {"tools": tools} if tools else {}
    r = client.chat.completions.create(model=model, messages=[user], max_tokens=max_tokens, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}}, **kw)
    msg = r.choices[0].message
    calls = msg.tool_calls or []
    call_ok = False
    if calls and calls[0].function.name == "add":
      try:
        call_ok = json.loads(calls[0].function.arguments) == {"a": a, "b": b}
      except ValueError:
        pass
    return {"tool": bool(tools), "exact": (msg.content or "").strip() == str(a + b), "call_ok": call_ok,
            "reply": (msg.content or "")[:40], "calls": [c.function.arguments for c in calls][:1]}

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(one, records))


def lora_rank_of(keys: list[str]) -> int:
  """The last lora_rank=R among the model keys (0: none)."""
  ranks = [int(k.split("=", 1)[1]) for k in keys if k.split("=", 1)[0] == "lora_rank"]
  return ranks[-1] if ranks else 0


def demo_config(argv: list[str]):
  """The Config of a train.py / serve argument list (after the module), on this process's one CPU device."""
  from MaxText.config import pyconfig
  yml = argv[0] if os.path.isabs(argv[0]) else os.path.join(REPO, argv[0])
  return pyconfig.initialize(["demo", yml, *argv[1:]], num_devices=1, ici_data_parallelism=1)


def write_base_sets(args, out: str) -> dict:
  """The base's conversations (BASE_OPS, BASE_TASK; the task's other flags: operands, counts, seed) under `out`."""
  return write_sets(argparse.Namespace(**{**vars(args), **BASE_TASK}), out, BASE_OPS)


def base_command(args, tokenizer: str, vocab_size: int, keys: list[str]) -> list[str]:
  """train.py's command for the base (--base trained): every weight from the random init on <work>/base_data
  (BASE_TASK) for --base_steps steps at the full fine-tune's learning rate, the model keys without LoRA's."""
  base = argparse.Namespace(**{**vars(args), "steps": args.base_steps, "learning_rate": LEARNING_RATE["full"]})
  return train_command(base, os.path.join(args.work, "base_data"), tokenizer, vocab_size,
                       [k for k in keys if not k.startswith(LORA_KEYS)], run_name="base")


def train_base(cmd: list[str], tokenizer: str, env: dict, work: str) -> tuple[str, bool]:
  """Runs the base's train command into <work>/base unless <work>/base/command.json says the same command over
  the same tokenizer (its bytes) already finished there -> (its checkpoints folder, whether it was reused)."""
  import hashlib
  base = os.path.join(work, "base")
  with open(tokenizer, "rb") as f:
    key = {"command": cmd[1:], "tokenizer_sha256": hashlib.sha256(f.read()).hexdigest()}
  done = os.path.join(base, "command.json")
  if os.path.exists(done):
    with open(done) as f:
      if json.load(f) == key:
        return os.path.join(base, "checkpoints"), True
  shutil.rmtree(base, ignore_errors=True)  # another base: train.py would resume from its checkpoints
  run(cmd, env, os.path.join(work, "base.log"))
  with open(done, "w") as f:
    json.dump(key, f)
  return os.path.join(base, "checkpoints"), False


def save_merged(config_yml: str, checkpoints: str, out: str) -> None:
  """A LoRA run's newest adapters merged into its base (load_parameters_path of its config.yml), saved as a
  parameter checkpoint of the model without adapters."""
  from MaxText.checkpoint import hf_export, model_state
  params, buffers = hf_export.restore_parameters(checkpoints, demo_config([config_yml]))
  model_state.save_parameters(out, params, buffers)


def checkpoint_bytes(cfg) -> int:
  """Bytes of what a run's checkpoint holds of its train state: the trained parameters, the buffers and AdamW's
  moments (under LoRA: the adapters and theirs, never the frozen base), from shapes alone."""
  import jax

  from MaxText import train
  from MaxText.checkpoint import model_state, orbax_state
  _, params, buffers = model_state.abstract_model(cfg)
  parts = train.model_parts(cfg, params.to_pure_dict(), buffers.to_pure_dict())
  opt = jax.eval_shape(train.make_optimizer(cfg, parts["params"]).init, parts["params"])
  return model_state.param_bytes(orbax_state.checkpointed(dict(parts, opt_state=opt)))


def serve_and_score(args, config_yml: str, extra: list[str], records: list[dict], name: str) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)

  def command(port):
    return [sys.executable, "-m", "MaxText.serve", config_yml, f"serve_port={port}",
            f"jax_cache_dir={os.path.join(args.work, 'jax_cache')}", "serve_width_buckets=1", "serve_context_buckets=1",
            f"serve_max_num_seqs={args.workers}", *extra]

  t0 = time.perf_counter()
  with started(command, env, os.path.join(args.work, f"serve_{name}.log")) as (_, url):
    print(f"{name}: server ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return score(url, "deepseek3.2-tiny", records, args.max_tokens, args.workers)


def rates(rows: list[dict]) -> tuple[float, float]:
  """(exact match over every conversation, tool-call accuracy over the tool conversations)."""
  tools = [r for r in rows if r["tool"]]
  answers = [r for r in rows if not r["tool"]]
  return (sum(r["exact"] for r in answers) / max(1, len(answers)),
          sum(r["call_ok"] for r in tools) / max(1, len(tools)))


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--work", required=True, help="folder for the data, the run, the logs and the compilation cache")
  add_arguments(p)
  p.set_defaults(low=0, high=10, tool_share=0.15, eval_tool_share=0.3, train=4000)  # single-digit sums; 15% (eval 30%) call add
  p.add_argument("--tokenizer", default="bpe",
                 help="'bpe': train a BPE tokenizer on the training conversations into <work>/tokenizer.json "
                      "(demos/sft_tokenizer.py; a tool conversation is ~160 tokens), or a tokenizer.json holding "
                      "V3.2's markers (tests/data/tokenizer.json: byte-level, a tool conversation is ~1050 tokens, "
                      "so --max_target_length 1088)")
  p.add_argument("--steps", type=int, default=None, help=f"default {STEPS['full']}, {STEPS['lora']} with lora_rank")
  p.add_argument("--batch", type=int, default=8, help="global_batch_size (rows of whole conversations)")
  p.add_argument("--learning_rate", type=float, default=None,
                 help=f"peak learning rate; default {LEARNING_RATE['full']} (full fine-tune), {LEARNING_RATE['lora']} "
                      "with lora_rank")
  p.add_argument("--max_target_length", type=int, default=256)
  p.add_argument("--score", type=int, default=100, help="held-out conversations scored (the first of eval.jsonl)")
  p.add_argument("--max_tokens", type=int, default=96,
                 help="a tool call turn is ~50 tokens (bpe; prompt + max_tokens must fit max_target_length), ~140 (bytes)")
  p.add_argument("--workers", type=int, default=8, help="concurrent requests (and serve_max_num_seqs)")
  p.add_argument("--quick", action="store_true", help=f"a loaded machine: {QUICK} instead")
  p.add_argument("--base", choices=["init", "trained"], default=None,
                 help="what SFT starts from: the random init, or a base trained first on BASE_TASK (products and "
                      "differences, the `mul` tool) into <work>/base; default: trained with lora_rank, else init")
  p.add_argument("--base_steps", type=int, default=300, help="the base's training steps (--base trained)")
  p.add_argument("--width", choices=["tiny", "wide"], default=None,
                 help="the model: deepseek3.2-tiny, or wide (WIDE_KEYS); default: wide with lora_rank, else tiny")
  return p


def parse_args(p: argparse.ArgumentParser, argv, default_keys) -> tuple[argparse.Namespace, list[str]]:
  """A demo's command line -> (its flags, the model keys key=value passed on to train and serve: default_keys,
  then the given ones, which override a default of the same key); anything else exits 2 in one line (argparse's
  error). So `lora_rank=16` trains the same model as the defaults alone."""
  args, extra = p.parse_known_args(argv)
  bad = [x for x in extra if "=" not in x]
  if bad:
    p.error(f"unknown argument {bad[0]!r}: flags are --name value, model keys key=value")
  return args, [*default_keys, *extra]


def settle(args: argparse.Namespace, given: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """The flags' defaults that depend on others (--quick's sizes; --base, --width, --learning_rate, --steps by full /
  LoRA training) -> (args, the model keys: DEFAULT_KEYS, WIDE_KEYS with --width wide, then the given ones).
  LoRA over the random init (--base init) is one line, exit 2: adapters adapt a model that knows the format."""
  rank = lora_rank_of(given)
  if args.quick:
    vars(args).update(QUICK)
  if args.base is None:
    args.base = "trained" if rank else "init"
  if args.width is None:
    args.width = "wide" if rank else "tiny"
  if rank and args.base == "init":
    print(f"error: lora_rank={rank} with --base init: LoRA adapts a trained base, not the random init "
          "(--base trained, the default with lora_rank; docs/sft.md#with-lora)", file=sys.stderr)
    raise SystemExit(2)
  if args.learning_rate is None:
    args.learning_rate = LEARNING_RATE["lora" if rank else "full"]
  if args.steps is None:
    args.steps = STEPS["lora" if rank else "full"]
  return args, [*DEFAULT_KEYS, *(WIDE_KEYS if args.width == "wide" else ()), *given]


def main(argv=None) -> None:
  args, extra = settle(*parse_args(parser(), argv, ()))
  t_start = time.perf_counter()
  data, base_data = os.path.join(args.work, "data"), os.path.join(args.work, "base_data")
  counts = write_sets(args, data)
  trained_base = args.base == "trained"
  if trained_base:
    write_base_sets(args, base_data)
  with open(os.path.join(data, "eval.jsonl")) as f:
    records = [json.loads(line) for line in f][:args.score]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  tokenizer, vocab_size = demo_tokenizer(args, data, *([base_data] if trained_base else []))
  cmd = train_command(args, data, tokenizer, vocab_size, extra)
  rank, merged = lora_rank_of(extra), os.path.join(args.work, "merged")
  base_s, reused = 0.0, False
  if trained_base:
    t0 = time.perf_counter()
    base, reused = train_base(base_command(args, tokenizer, vocab_size, extra), tokenizer, env, args.work)
    base_s = time.perf_counter() - t0
    print(f"base: {'reused ' + base if reused else f'trained {args.base_steps} steps in {base_s:.0f} s'}",
          file=sys.stderr, flush=True)
    cmd.append(f"load_parameters_path={base}")
  shutil.rmtree(os.path.join(args.work, "sft"), ignore_errors=True)  # a rerun trains again (train.py would resume)
  t0 = time.perf_counter()
  run(cmd, env, os.path.join(args.work, "train.log"))
  train_s = time.perf_counter() - t0
  print(f"trained {args.steps} steps in {train_s:.0f} s", file=sys.stderr, flush=True)
  config_yml = os.path.join(args.work, "sft", "config.yml")
  checkpoints = os.path.join(args.work, "sft", "checkpoints")
  if rank:
    save_merged(config_yml, checkpoints, merged)
  # "before" serves what SFT started from: the run's own config.yml (its load_parameters_path: the base, if any)
  no_lora = ["lora_rank=0"] if rank else []
  before = serve_and_score(args, config_yml, no_lora, records, "before")
  after = serve_and_score(args, config_yml, [f"load_parameters_path={merged if rank else checkpoints}", *no_lora],
                          records, "after")
  (em0, tool0), (em1, tool1) = rates(before), rates(after)
  with open(os.path.join(args.work, "replies.json"), "w") as f:
    json.dump({"before": before, "after": after}, f, indent=1)
  wall_s = time.perf_counter() - t_start
  n_tool = sum(r["tool"] for r in after)
  started = (f"the base: {args.base_steps} steps on products and differences" + (", reused" if reused else
             f", {base_s / 60:.1f} min")) if trained_base else "random init"
  print(f"\n| model ({args.width}) | exact match ({len(after) - n_tool} conversations) | tool-call accuracy ({n_tool}) |"
        "\n|---|---|---|")
  print(f"| before SFT ({started}) | {em0:.0%} | {tool0:.0%} |")
  how = f"LoRA rank {rank}, " if rank else ""
  print(f"| after SFT ({how}{args.steps} steps, {train_s / 60:.1f} min) | {em1:.0%} | {tool1:.0%} |")
  print(f"wall {wall_s / 60:.1f} min (data, tokenizer, base, SFT, both servers, scoring)")
  state = {}
  if rank:
    cfg = demo_config([config_yml])
    lora_b, full_b = checkpoint_bytes(cfg), checkpoint_bytes(cfg.model_copy(update={"lora_rank": 0}))
    state = {"lora_state_bytes": lora_b, "full_state_bytes": full_b, "state_ratio": round(lora_b / full_b, 4)}
    print(f"checkpointed train state: LoRA {lora_b:,} bytes, full fine-tune {full_b:,} bytes ({lora_b / full_b:.1%})")
  print(json.dumps({"exact_match_before": round(em0, 3), "exact_match_after": round(em1, 3),
                    "tool_call_accuracy": round(tool1, 3), "tool_call_accuracy_before": round(tool0, 3),
                    "scored": len(after), "tool_conversations": n_tool, "train_conversations": counts["train"],
                    "base": args.base, "base_steps": args.base_steps if trained_base else 0, "base_s": round(base_s),
                    "base_reused": reused, "steps": args.steps, "train_s": round(train_s), "wall_s": round(wall_s),
                    "extra": extra, **state}))


if __name__ == "__main__":
  main()
