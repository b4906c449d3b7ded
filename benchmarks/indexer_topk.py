"""Indexer top-k selection + mask: lax.top_k vs approx_max_k vs MaxText/kernels/selection.py.

    python benchmarks/indexer_topk.py                 # the full table
    python benchmarks/indexer_topk.py --quick         # one shape, fewer repeats
    python benchmarks/indexer_topk.py --shapes 1x1024x65536 --ks 2048 --repeats 7

Prints per method the median (and min) wall time and the min CPU time of the boolean mask [b,t,s] from random
f32 scores, timed interleaved, and recall = |mask & exact| / |exact| (est.: the recall ours approx aimed for).
"""

from __future__ import annotations

import argparse
import os

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing
from MaxText.kernels import backend  # noqa: E402
from MaxText.kernels import selection as sel  # noqa: E402

SHAPES = ["1x1024x8192", "1x1024x65536", "1x1024x131072"]  # the last: 128K context at 128-way cp
KS = [64, 256, 2048]
RECALL = 0.95  # the approximate methods' recall_target


def _ours(fn):
  """fn traced with our binned selection (kernels/backend.py), whatever this backend's row says."""
  def traced(x):
    with backend.forced(exact_selection="binned", approx_selection="binned"):
      return fn(x)
  return traced


def methods(k: int, recall_target: float):
  """name -> scores [b,t,s] -> bool mask [b,t,s]. The "ours" rows run the binned selection on
  every backend (on GPU/TPU, kernels/backend.py would otherwise pick lax.top_k / approx_max_k)."""
  mask = lambda x, values, indices=None: sel.generate_mask(x, values, indices, exact_topk=True, k=k)  # noqa: E731
  approx = dict(approx=True, recall_target=recall_target)
  return {  # the first: the seed's baseline (sorted top_k, then the k-th value as the cutoff)
      "top_k + threshold mask (baseline)": lambda x: mask(x, jax.lax.top_k(x, k)[0]),
      "approx_max_k + index mask": lambda x: mask(x, *jax.lax.approx_max_k(x, k, recall_target=recall_target)),
      "ours exact: topk_threshold + generate_mask": _ours(lambda x: mask(x, sel.topk_threshold(x, k))),
      "ours exact fused: topk_mask": _ours(lambda x: sel.topk_mask(x, k)),
      "ours approx: select_topk(approx) + scatter mask": _ours(lambda x: mask(x, *sel.select_topk(x, k, **approx))),
      # the same set; a per-block mask from k >= s/128 (what Indexer.select runs)
      "ours approx fused: topk_mask(approx)": _ours(lambda x: sel.topk_mask(x, k, **approx)),
  }


def time_all(fns: dict, x, repeats: int) -> dict:
  """name -> (median ms, min ms, min cpu ms, mask), timed interleaved (timing.interleaved); cpu ms is this
  process's CPU time (all threads): less sensitive to other users of the cores."""
  jitted, cpu = {name: jax.jit(fn) for name, fn in fns.items()}, {}
  wall, out = timing.interleaved({name: lambda fn=fn: fn(x) for name, fn in jitted.items()}, repeats, 0, cpu)
  return {name: (float(np.median(wall[name])) * 1e3, float(np.min(wall[name])) * 1e3,
                 float(np.min(cpu[name])) * 1e3, np.asarray(out[name])) for name in fns}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=None, help="bxtxs, e.g. 1x1024x65536")
  parser.add_argument("--ks", nargs="+", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--quick", action="store_true", help="one shape (1x1024x65536), 3 repeats")
  args = parser.parse_args()
  shapes = args.shapes or (["1x1024x65536"] if args.quick else SHAPES)
  ks = args.ks or KS
  # 7: one call at f32[1,1024,131072] varies by +-15% on a 2-core VM (page faults of the fresh
  # 128 MiB mask); the median of 5 moved a ratio by up to 0.7x between runs.
  repeats = args.repeats or (3 if args.quick else 7)

  print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus), load average "
        f"{os.getloadavg()[0]:.2f}; median/min of {repeats} interleaved runs; recall_target {RECALL}")
  header = (f"{'shape':>18} {'k':>5}  {'method':<48} {'median ms':>10} {'min ms':>8} {'cpu ms':>8} "
            f"{'speedup':>8} {'recall':>7} {'est.':>7}")
  print(header)
  print("-" * len(header))
  for shape_str in shapes:
    shape = tuple(int(d) for d in shape_str.split("x"))
    label = "f32[" + shape_str.replace("x", ",") + "]"
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    for k in ks:
      results = time_all(methods(k, RECALL), x, repeats)
      baseline_ms, _, _, exact = next(iter(results.values()))
      config = sel.binned_config(shape[-1], min(k, shape[-1]), RECALL)
      for name, (median, best, cpu, mask) in results.items():
        recall = (mask & exact).sum() / exact.sum()
        est = ""  # ours approx: the estimate its (G, m) was chosen by
        if name.startswith("ours approx") and config is not None:
          est = f"{sel.binned_recall(-(-shape[-1] // config[0]) * config[0], min(k, shape[-1]), *config):.4f}"
        print(f"{label:>18} {k:>5}  {name:<48} {median:>10.1f} {best:>8.1f} {cpu:>8.1f} "
              f"{baseline_ms / median:>7.1f}x {recall:>7.4f} {est:>7}", flush=True)
    del x
  print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
  main()
