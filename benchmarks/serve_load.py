"""Our OpenAI server vs `transformers serve` on the SAME weights, one seeded workload over HTTP.

    python benchmarks/serve_load.py --config RUN/config.yml --checkpoint RUN/checkpoints
    python benchmarks/serve_load.py --quick     # random weights of the tiny model, concurrency 1 and 8

The weights are exported once (MaxText.export_hf_checkpoint) and served by `python -m MaxText.serve` and by
`transformers serve EXPORT --continuous-batching --device cpu` (which needs `accelerate`), one at a time, c
closed-loop clients per --concurrency level. Prints TTFT, TPOT and output tokens/s per server and level, then
one JSON line with throughput_ratio (ours / theirs) and ttft_p50_ratio (theirs / ours).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")


def export_weights(args, work: str) -> tuple[str, str]:
  """-> (our load_parameters_path, the HF export folder with the tokenizer)."""
  from MaxText.checkpoint import hf_export, model_state
  from MaxText.config import pyconfig
  from MaxText.runtime import sharding
  ckpt = args.checkpoint
  if not ckpt:
    cfg = pyconfig.initialize(["bench", args.config, *args.overrides], num_devices=1)
    graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
    ckpt = os.path.join(work, "params")
    model_state.save_parameters(ckpt, params, buffers)
  hf = os.path.join(work, "hf")
  hf_export.export(ckpt, hf, args.config, args.overrides, "float32")
  shutil.copy(os.path.join(DATA, "tokenizer.json"), os.path.join(hf, "tokenizer.json"))
  with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return ckpt, hf


def workload(args, n: int, seed: int) -> list[tuple[str, int]]:
  """n (prompt, max_tokens), seeded; max_tokens cut so that prompt + output fit --context tokens."""
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(os.path.join(DATA, "tokenizer.json"))
  words = open(os.path.join(DATA, "corpus.txt"), encoding="utf-8").read().split()
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    k = int(rng.integers(4, 33))  # prompt words
    at = int(rng.integers(0, len(words) - k))
    prompt = " ".join(words[at:at + k])
    room = args.context - len(tok.encode(prompt, add_special_tokens=False).ids)
    out.append((prompt, min(int(rng.integers(*((8, 25) if args.quick else (16, 65)))), room)))  # output tokens
  return out


def free_port() -> int:
  """A free port on the loopback."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def started(command, env: dict, log_path: str, timeout: float = 600):
  """A server up: command(port) on a free loopback port, in its own session, its output in log_path -> (its process,
  its URL) once /health answers 200; stopped (SIGTERM, SIGKILL after 60 s) when the block ends."""
  import httpx
  port = free_port()
  url, cmd = f"http://127.0.0.1:{port}", command(port)
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
      with contextlib.suppress(httpx.TransportError):
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      time.sleep(0.5)
    else:
      why = f"not healthy after {timeout} s" if proc.poll() is None else f"exited {proc.returncode}"
      raise RuntimeError(f"{cmd[:3]} {why}; see {log_path}")
    yield proc, url
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGTERM)
      try:
        proc.wait(60)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, extra: dict) -> tuple[float, ...]:
  """-> (ttft, tpot, end time, tokens, prompt tokens) of one streamed request."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}, **extra}
  t0 = time.perf_counter()
  first = last = None
  tokens = prompt_tokens = 0
  async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if "error" in chunk:
        raise RuntimeError(f"{url}: {chunk['error']}")
      if chunk.get("choices"):
        last = time.perf_counter()
        first = first or last
      if chunk.get("usage"):
        tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
  end = time.perf_counter()
  first = first or end
  return first - t0, (end - first) / max(tokens - 1, 1), end, tokens, prompt_tokens


async def run_level(url: str, model: str, work: list[tuple[str, int]], concurrency: int, extra: dict) -> dict:
  import httpx
  todo = list(enumerate(work))
  results = [None] * len(work)

  async def client_loop(client):
    while todo:
      i, (prompt, n) = todo.pop(0)
      results[i] = await _one(client, url, model, prompt, n, extra)

  limits = httpx.Limits(max_connections=concurrency + 4)
  async with httpx.AsyncClient(timeout=600, limits=limits) as client:
    t0 = time.perf_counter()
    await asyncio.gather(*[client_loop(client) for _ in range(concurrency)])
    t1 = time.perf_counter()
  ttft = np.array([r[0] for r in results])
  tpot = np.array([r[1] for r in results])
  tokens = sum(r[3] for r in results)
  return {"requests": len(work), "prompt_tokens": sum(r[4] for r in results), "tokens": tokens,
          "tokens_per_s": tokens / (t1 - t0),
          "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
          "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99))}


def bench(url: str, levels, works, model: str | None = None, extra: dict | None = None) -> dict:
  import httpx
  model, extra = model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"], extra or {}
  asyncio.run(run_level(url, model, works[levels[0]][:1], 1, extra))  # warm: the first request's own costs
  return {c: asyncio.run(run_level(url, model, works[c], c, extra)) for c in levels}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="configs/base.yml")
  ap.add_argument("--checkpoint", default="", help="our checkpoint (default: random init of --config)")
  ap.add_argument("--concurrency", default="1,8,32")
  ap.add_argument("--requests", type=int, default=2, help="requests per client at each concurrency (at least 8)")
  ap.add_argument("--context", type=int, default=128, help="max_target_length of the model served")
  ap.add_argument("--chunk", type=int, default=16, help="our prefill_chunk_size (16 beat 64 at concurrency 32 here)")
  ap.add_argument("--no-theirs", action="store_true")
  ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, outputs of 8..24 tokens")
  ap.add_argument("overrides", nargs="*", metavar="key=value")
  args = ap.parse_args(argv)
  if args.quick:
    args.concurrency = "1,8"
  if not args.checkpoint and not args.overrides:
    args.overrides = ["max_target_length=128", "mtp_num_layers=0", "param_init_std=0.2"]
  levels = [int(c) for c in args.concurrency.split(",")]
  works = {c: workload(args, max(8, args.requests * c), c) for c in levels}
  work = tempfile.mkdtemp(prefix="serve-load-")
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  try:
    ckpt, hf = export_weights(args, work)
    rows, theirs_mode = {}, None
    ours = [sys.executable, "-m", "MaxText.serve", args.config, *args.overrides, f"load_parameters_path={ckpt}",
            "tokenizer_type=hf", f"tokenizer_path={hf}/tokenizer.json", "add_bos=false",
            f"serve_max_num_seqs={max(levels)}", "serve_page_size=16", f"prefill_chunk_size={args.chunk}"]
    with started(lambda port: [*ours, f"serve_port={port}"], env, os.path.join(work, "ours.log")) as (_, url):
      rows["ours"] = bench(url, levels, works, extra={"ignore_eos": True})
    if not args.no_theirs:
      exe = os.path.join(os.path.dirname(sys.executable), "transformers")
      for cb in (["--continuous-batching"], []):
        def theirs(port, cb=cb):
          return [exe, "serve", hf, *cb, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]

        try:
          with started(theirs, env, os.path.join(work, "theirs.log")) as (_, url):
            rows["theirs"] = bench(url, levels, works, model=hf)  # its models are named by their folder
          theirs_mode = "continuous-batching" if cb else theirs_mode
          break
        except RuntimeError as e:
          if not cb:
            raise
          failed = str(e)[:200]
        log = open(os.path.join(work, "theirs.log")).read()
        why = (re.findall(r"^(\w+Error: .*)$", log, re.M) or [failed])[-1]
        theirs_mode = f"no continuous batching (--continuous-batching failed: {why})"
        print(f"transformers serve --continuous-batching failed ({why}); measuring it without", file=sys.stderr)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  report(rows, levels, theirs_mode)


def report(rows: dict, levels: list[int], theirs_mode: str | None) -> None:
  print(f"{'server':8} {'conc':>4} {'reqs':>5} {'prompt':>6} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9}  (seconds)")
  for name, by in rows.items():
    for c in levels:
      r = by[c]
      print(f"{name:8} {c:>4} {r['requests']:>5} {r['prompt_tokens']:>6} {r['tokens']:>6} {r['tokens_per_s']:>8.1f} {r['ttft_p50']:>9.4f} "
            f"{r['ttft_p99']:>9.4f} {r['tpot_p50']:>9.4f} {r['tpot_p99']:>9.4f}")
  out = {"theirs": theirs_mode}
  if "theirs" in rows:
    top = max(levels)
    out["throughput_ratio"] = round(rows["ours"][top]["tokens_per_s"] / rows["theirs"][top]["tokens_per_s"], 3)
    out["throughput_ratio_at"] = top
    out["ttft_p50_ratio"] = round(min(rows["theirs"][c]["ttft_p50"] / rows["ours"][c]["ttft_p50"] for c in levels), 3)
  out["levels"] = {name: {str(c): {k: round(v, 4) if isinstance(v, float) else v for k, v in by[c].items()}
                          for c in levels} for name, by in rows.items()}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
