r"""Seconds from `python -m MaxText.serve` to /health 200, started twice in a row: with JAX's
persistent compilation cache off (jax_cache_dir="") and on (a fresh folder as jax_cache_dir). The
second start with the cache reads every step program back instead of compiling it.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_start.py [key=value ...]   # extra keys go to the server

Prints a table and one JSON line. The environment's JAX_COMPILATION_CACHE_DIR and
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS are removed for the children (so the key decides).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

from benchmarks.serve_load import REPO, _free_port, start, stop


def time_to_ready(cache_dir: str, extra: list[str], log_path: str) -> tuple[float, float]:
  """-> (seconds from the command to /health 200, of which the engine's warmup: its step programs)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  port = _free_port()
  cache_key = f"jax_cache_dir={cache_dir}" if cache_dir else 'jax_cache_dir=""'
  cmd = [sys.executable, "-m", "MaxText.serve", "configs/base.yml", f"serve_port={port}", cache_key, *extra]
  t0 = time.perf_counter()
  proc = start(cmd, env, f"http://127.0.0.1:{port}", log_path)
  seconds = time.perf_counter() - t0
  stop(proc)
  with open(log_path) as f:
    warmup = re.search(r"compiled \d+ step programs in ([\d.]+) s", f.read())
  return seconds, float(warmup.group(1)) if warmup else float("nan")


def main(extra: list[str]) -> None:
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
  print(json.dumps({"off_first_s": round(t["off", 1], 1), "off_second_s": round(t["off", 2], 1),
                    "on_first_s": round(t["on", 1], 1), "on_second_s": round(t["on", 2], 1),
                    "on_second_warmup_s": round(rows[-1][3], 1),
                    "second_start_speedup": round(t["off", 2] / t["on", 2], 2), "cache_entries": entries}))


if __name__ == "__main__":
  main(sys.argv[1:])
