"""Timing shared by the benchmarks: variants called in turn, so a shared host's drifting load hits all alike."""

from __future__ import annotations

import statistics
import time

import jax
import yaml


def interleaved(fns: dict, iters: int, warmup: int = 1, cpu: dict | None = None
                ) -> tuple[dict[str, list[float]], dict]:
  """fns {name: () -> arrays}: each called once (compiling it; its output kept) and `warmup` more times, then
  `iters` rounds of one call of each, every call waited for -> ({name: [seconds of each timed call]},
  {name: its first output}). Call i of every variant ran back to back (paired ratios). cpu: a dict that gets
  {name: [this process's CPU seconds of each timed call]} too."""
  first = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  cpu = {} if cpu is None else cpu
  cpu.update({name: [] for name in fns})
  for _ in range(iters):
    for name, fn in fns.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return times, first


def median_ms(fn, iters: int, warmup: int = 1) -> float:
  """Milliseconds of fn () -> arrays, the median of `iters` calls after its first call and `warmup` more."""
  return statistics.median(interleaved({"fn": fn}, iters, warmup)[0]["fn"]) * 1e3


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, list[float]]:
  """(median, [first quartile, third quartile]) of num[i] / den[i]: the ratio of calls made back to back."""
  r = [a / b for a, b in zip(num, den)]
  q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
  return statistics.median(r), [q[0], q[2]]


def failure(e: BaseException) -> str:
  """A failed run's row: the exception's type and the first line of its message."""
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def overrides(pairs) -> dict:
  """KEY=VALUE strings -> {key: the value read as YAML}; ValueError for a string without '='."""
  if bad := [a for a in pairs if "=" not in a]:
    raise ValueError(f"--set takes KEY=VALUE pairs, got {bad[0]!r}")
  return {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in pairs)}


def parse(ap, argv, set_help: str, rungs: bool = False):
  """ap's flags and --set KEY=VALUE model overrides (rungs: repeatable, one rung each), --force CHOICE=VALUE parsed
  -> (args, the --force choices); a bad --set or --force pair is one usage line."""
  from MaxText.kernels import backend
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", action="append" if rungs else "store",
                  help=set_help)
  ap.add_argument("--force", nargs="*", default=[], metavar="CHOICE=VALUE",
                  help="kernels/backend.py choices over this backend's row (backend.forced)")
  args = ap.parse_args(argv)
  try:
    for rung in args.set if args.set and isinstance(args.set[0], list) else [args.set]:
      overrides(rung)
    return args, backend.parse_forced(args.force)
  except ValueError as e:
    ap.error(str(e))
