"""What starting a server costs: seconds from `python -m MaxText.serve` to /health 200, twice with JAX's
persistent compilation cache off and twice on (a fresh folder); --contexts: the seconds the engine's warmup
takes to compile a few serving contexts' step programs, cache off.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_start.py [key=value ...]   # extra keys go to the server
    PYTHONPATH=. .venv/bin/python benchmarks/serve_start.py --contexts [key=value ...]   # extra keys: every row

Prints a table and one JSON line.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

from benchmarks.serve_load import REPO, started


def time_to_ready(cache_dir: str, extra: list[str], log_path: str) -> tuple[float, float]:
  """-> (seconds from the command to /health 200, of which the engine's warmup: its step programs)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  cache_key = f"jax_cache_dir={cache_dir}" if cache_dir else 'jax_cache_dir=""'
  t0 = time.perf_counter()
  with started(lambda port: [sys.executable, "-m", "MaxText.serve", "configs/base.yml", f"serve_port={port}", cache_key,
                             *extra], env, log_path):
    seconds = time.perf_counter() - t0
  with open(log_path) as f:
    warmup = re.search(r"compiled \d+ step programs in ([\d.]+) s", f.read())
  return seconds, float(warmup.group(1)) if warmup else float("nan")


CONTEXTS = {  # --contexts: name -> overrides (the cheapest first: each row prints as it ends)
    "1024, 4 seqs, 1 width, 1 context": {"max_target_length": 1024, "serve_max_num_seqs": 4,
                                         "serve_width_buckets": 1, "serve_context_buckets": 1},
    "64 (a small run's context)": {"max_target_length": 64},
    "1024": {"max_target_length": 1024},
}


def contexts(extra: list[str]) -> None:
  """--contexts: each CONTEXTS row's engine built in this process and warmed up (every program compiled once)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from MaxText.checkpoint import model_state
  from MaxText.config import pyconfig
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  jax.config.update("jax_enable_compilation_cache", False)
  out = {}
  print("| context | step programs | warmup s |\n| --- | --- | --- |")
  for name, keys in CONTEXTS.items():
    config = pyconfig.initialize(["serve_start", "configs/base.yml", *[f"{k}={v}" for k, v in keys.items()], *extra],
                                 jax_cache_dir="")
    mesh = sharding.create_mesh(config)
    with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
      engine = ServingEngine(config, *model_state.create(config, mesh)[:3])
      t = time.perf_counter()
      n = engine.warmup()
      seconds = time.perf_counter() - t
    out[name] = {"programs": n, "warmup_s": round(seconds, 1)}
    print(f"| {name} | {n} | {seconds:.1f} |", flush=True)
  print(json.dumps(out))


def main(extra: list[str]) -> None:
  if "--contexts" in extra:
    contexts([a for a in extra if a != "--contexts"])
    return
  with tempfile.TemporaryDirectory(prefix="serve-start-") as tmp:
    rows = []
    for arm, cache in (("off", ""), ("on", os.path.join(tmp, "jax_cache"))):
      for n in (1, 2):
        rows.append((arm, n, *time_to_ready(cache, extra, os.path.join(tmp, f"{arm}{n}.log"))))
        print(f"cache {arm}, start {n}: {rows[-1][2]:.1f} s (warmup {rows[-1][3]:.1f} s)", file=sys.stderr, flush=True)
    entries = sum(len(f) for _, _, f in os.walk(os.path.join(tmp, "jax_cache")))
  print("\n| compilation cache | start | seconds to /health 200 | of which the warmup (step programs) |\n|---|---|---|---|")
  for arm, n, s, w in rows:
    print(f"| {arm} | {n} | {s:.1f} | {w:.1f} |")
  t = {(a, n): s for a, n, s, _ in rows}
  print(json.dumps({f"{a}_{('first', 'second')[n - 1]}_s": round(s, 1) for a, n, s, _ in rows}
                   | {"on_second_warmup_s": round(rows[-1][3], 1),
                    "second_start_speedup": round(t["off", 2] / t["on", 2], 2), "cache_entries": entries}))


if __name__ == "__main__":
  main(sys.argv[1:])
