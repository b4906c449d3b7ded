"""Timing shared by the benchmarks: variants called in turn, so a shared host's drifting load hits all alike."""

from __future__ import annotations

import statistics
import time

import jax


def interleaved(fns: dict, iters: int, warmup: int = 1) -> tuple[dict[str, list[float]], dict]:
  """fns {name: () -> arrays}: each called once (compiling it; its output kept) and `warmup` more times, then
  `iters` rounds of one call of each, every call waited for -> ({name: [seconds of each timed call]},
  {name: its first output}). Call i of every variant ran back to back (paired ratios)."""
  first = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(iters):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  return times, first


def median_ms(fn, iters: int, warmup: int = 1) -> float:
  """Milliseconds of fn () -> arrays, the median of `iters` calls after its first call and `warmup` more."""
  return statistics.median(interleaved({"fn": fn}, iters, warmup)[0]["fn"]) * 1e3


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, list[float]]:
  """(median, [first quartile, third quartile]) of num[i] / den[i]: the ratio of calls made back to back."""
  r = [a / b for a, b in zip(num, den)]
  q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
  return statistics.median(r), [q[0], q[2]]
