"""Indexer top-k selection + mask: lax.top_k vs approx_max_k vs MaxText/layers/selection.py.

    python benchmarks/indexer_topk.py                 # the full table
    python benchmarks/indexer_topk.py --quick         # one shape, fewer repeats
    python benchmarks/indexer_topk.py --shapes 1x1024x65536 --ks 2048 --repeats 7

Each method produces the boolean selection mask [b,t,s] from random f32 scores (the shape of
one device's indexer scores). Every method is jitted, warmed up, timed with block_until_ready,
and reported as the median (and min) over repeats. recall = |mask & exact| / |exact|, where
exact is the top_k mask. A table, never a timed assert: timings on a shared CPU are noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.layers import selection as sel  # noqa: E402

SHAPES = ["1x1024x8192", "1x1024x65536", "1x256x131072"]
KS = [64, 256, 2048]
REFERENCE_LIMIT_BYTES = 2 << 30  # the all-pairs mask's [b,t,k,s] bool intermediate


def methods(k: int, recall_target: float):
  """name -> scores [b,t,s] -> bool mask [b,t,s]."""
  def topk_threshold_mask(x):  # the seed's baseline: sorted top_k, then the k-th value as cutoff
    values, _ = jax.lax.top_k(x, k)
    return sel.generate_mask(x, values, exact_topk=True, k=k)

  def approx_max_k_mask(x):
    values, indices = jax.lax.approx_max_k(x, k, recall_target=recall_target)
    return sel.generate_mask(x, values, indices, exact_topk=True, k=k)

  def ours_exact(x):
    return sel.generate_mask(x, sel.topk_threshold(x, k), exact_topk=True, k=k)

  def ours_approx(x):
    values, indices = sel.select_topk(x, k, approx=True, recall_target=recall_target)
    return sel.generate_mask(x, values, indices, exact_topk=True, k=k)

  def reference(x):  # the original all-pairs index compare
    return sel.generate_mask_reference(jax.lax.top_k(x, k)[1], x.shape[-1])

  return {
      "top_k + threshold mask (baseline)": topk_threshold_mask,
      "approx_max_k + index mask": approx_max_k_mask,
      "ours exact: topk_threshold + generate_mask": ours_exact,
      "ours approx: select_topk(approx) + scatter mask": ours_approx,
      "top_k + reference all-pairs mask": reference,
  }


def time_it(fn, x, repeats: int) -> tuple[float, float, np.ndarray]:
  fn = jax.jit(fn)
  out = jax.block_until_ready(fn(x))  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3, float(np.min(times)) * 1e3, np.asarray(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=None, help="bxtxs, e.g. 1x1024x65536")
  parser.add_argument("--ks", nargs="+", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--recall_target", type=float, default=0.95)
  parser.add_argument("--quick", action="store_true", help="one shape (1x1024x65536), 3 repeats")
  args = parser.parse_args()
  shapes = args.shapes or (["1x1024x65536"] if args.quick else SHAPES)
  ks = args.ks or KS
  repeats = args.repeats or (3 if args.quick else 5)

  print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus), load average "
        f"{os.getloadavg()[0]:.2f}; median/min of {repeats} runs; recall_target {args.recall_target}")
  header = f"{'shape':>18} {'k':>5}  {'method':<48} {'median ms':>10} {'min ms':>8} {'speedup':>8} {'recall':>7}"
  print(header)
  print("-" * len(header))
  for shape_str in shapes:
    shape = tuple(int(d) for d in shape_str.split("x"))
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    for k in ks:
      exact = baseline_ms = None
      for name, fn in methods(k, args.recall_target).items():
        if name.startswith("top_k + reference") and np.prod(shape) * k > REFERENCE_LIMIT_BYTES:
          gib = np.prod(shape) * k / 2**30
          print(f"{'f32[' + shape_str.replace('x', ',') + ']':>18} {k:>5}  {name:<48} "
                f"skipped: its [b,t,k,s] intermediate is {gib:.0f} GiB")
          continue
        median, best, mask = time_it(fn, x, repeats)
        if exact is None:
          exact, baseline_ms = mask, median
        recall = (mask & exact).sum() / exact.sum()
        print(f"{'f32[' + shape_str.replace('x', ',') + ']':>18} {k:>5}  {name:<48} {median:>10.1f} {best:>8.1f} "
              f"{baseline_ms / median:>7.1f}x {recall:>7.4f}", flush=True)
    del x


if __name__ == "__main__":
  main()
