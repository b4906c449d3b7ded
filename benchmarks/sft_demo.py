r"""The SFT demo, end to end: synthetic conversations -> train.py use_sft=true -> python -m MaxText.serve
-> held-out conversations scored through /v1/chat/completions with the openai client, before and
after SFT.

    PYTHONPATH=. .venv/bin/python benchmarks/sft_demo.py --work /tmp/sft_demo [--steps 300 ...] [key=value ...]

1. benchmarks/sft_conversations.py writes <work>/data/{train,eval}.jsonl (additions with a one-line
   thinking trace; a share where the assistant calls the `add` tool, gets its result and answers).
2. train.py trains the tiny model (configs/base.yml, model deepseek3.2-tiny, from its random init,
   seed fixed) with use_sft=true for --steps steps into <work>/sft; extra key=value go to train and serve.
3. The server starts twice on a free 127.0.0.1 port from the run's config.yml: without
   load_parameters_path (the same random init: "before") and with <work>/sft/checkpoints ("after");
   both share a JAX compilation cache under <work>, so the second start reads the programs back.
4. Each held-out conversation's first user turn is sent (temperature 0, thinking on, the record's
   tools): exact match = the reply's content is the sum; tool accuracy = a tool conversation's reply
   has parsed tool_calls calling add with {"a": a, "b": b}.

Prints a table and one JSON line (exact_match_before, exact_match_after, tool_call_accuracy, ...).
The V3.2 tools block of the system prompt is ~1000 tokens with tests/data/tokenizer.json, so a tool
conversation needs max_target_length >= 1048 (the default 1088); each SFT row holds whole conversations.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time

from benchmarks.serve_load import REPO, _free_port, start, stop
from benchmarks.sft_conversations import add_arguments, write_sets

TOKENIZER = os.path.join(REPO, "tests", "data", "tokenizer.json")


def run(cmd: list[str], env: dict, log_path: str) -> None:
  import subprocess
  with open(log_path, "w") as log:
    rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  if rc:
    raise SystemExit(f"error: {' '.join(cmd[:3])} exited {rc}; see {log_path}")


def train_command(args, data: str, extra: list[str]) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", "use_sft=true", "train_data_columns=[messages]",
          "dataset_type=file", f"dataset_path={data}/train.jsonl", "tokenizer_type=hf", f"tokenizer_path={TOKENIZER}",
          f"max_target_length={args.max_target_length}", f"max_prefill_length={args.max_target_length}",
          f"global_batch_size={args.batch}", f"steps={args.steps}", f"learning_rate={args.learning_rate}",
          f"warmup_steps={max(1, args.steps // 20)}", f"checkpoint_period={args.steps}", "log_period=10",
          "async_checkpointing=false", f"base_output_directory={args.work}", "run_name=sft", *extra]


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


def serve_and_score(args, config_yml: str, extra: list[str], records: list[dict], name: str) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  port = _free_port()
  cmd = [sys.executable, "-m", "MaxText.serve", config_yml, f"serve_port={port}",
         f"jax_cache_dir={os.path.join(args.work, 'jax_cache')}", "serve_width_buckets=1", "serve_context_buckets=1",
         f"serve_max_num_seqs={args.workers}", *extra]
  t0 = time.perf_counter()
  proc = start(cmd, env, f"http://127.0.0.1:{port}", os.path.join(args.work, f"serve_{name}.log"))
  print(f"{name}: server ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
  try:
    return score(f"http://127.0.0.1:{port}", "deepseek3.2-tiny", records, args.max_tokens, args.workers)
  finally:
    stop(proc)


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
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=4, help="global_batch_size (rows of whole conversations)")
  p.add_argument("--learning_rate", type=float, default=3e-3)
  p.add_argument("--max_target_length", type=int, default=1088)
  p.add_argument("--score", type=int, default=40, help="held-out conversations scored (the first of eval.jsonl)")
  p.add_argument("--max_tokens", type=int, default=160, help="a tool call turn is ~140 tokens")
  p.add_argument("--workers", type=int, default=8, help="concurrent requests (and serve_max_num_seqs)")
  return p


def main(argv=None) -> None:
  p = parser()
  args, extra = p.parse_known_args(argv)
  bad = [x for x in extra if "=" not in x]
  if bad:
    p.error(f"unknown argument {bad[0]!r}: flags are --name value, model keys key=value")
  extra = extra or ["mtp_num_layers=0", "remat_policy=none"]
  data = os.path.join(args.work, "data")
  counts = write_sets(args, data)
  with open(os.path.join(data, "eval.jsonl")) as f:
    records = [json.loads(line) for line in f][:args.score]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  t0 = time.perf_counter()
  run(train_command(args, data, extra), env, os.path.join(args.work, "train.log"))
  train_s = time.perf_counter() - t0
  print(f"trained {args.steps} steps in {train_s:.0f} s", file=sys.stderr, flush=True)
  config_yml = os.path.join(args.work, "sft", "config.yml")
  before = serve_and_score(args, config_yml, [], records, "before")
  after = serve_and_score(args, config_yml, [f"load_parameters_path={os.path.join(args.work, 'sft', 'checkpoints')}"],
                          records, "after")
  (em0, tool0), (em1, tool1) = rates(before), rates(after)
  with open(os.path.join(args.work, "replies.json"), "w") as f:
    json.dump({"before": before, "after": after}, f, indent=1)
  n_tool = sum(r["tool"] for r in after)
  print(f"\n| model | exact match ({len(after) - n_tool} conversations) | tool-call accuracy ({n_tool}) |\n|---|---|---|")
  print(f"| before SFT (random init) | {em0:.0%} | {tool0:.0%} |")
  print(f"| after SFT ({args.steps} steps, {train_s / 60:.1f} min) | {em1:.0%} | {tool1:.0%} |")
  print(json.dumps({"exact_match_before": round(em0, 3), "exact_match_after": round(em1, 3),
                    "tool_call_accuracy": round(tool1, 3), "tool_call_accuracy_before": round(tool0, 3),
                    "scored": len(after), "tool_conversations": n_tool, "train_conversations": counts["train"],
                    "steps": args.steps, "train_s": round(train_s), "extra": extra}))


if __name__ == "__main__":
  main()
