"""What the paged indexer scoring pays per page, and the selected positions' page lookup, at decode shapes.

    python benchmarks/scoring_pages.py                                   # TPU: 16 rows x 128K
    python benchmarks/scoring_pages.py --rows 2 --context 4096 --interpret --iters 1   # any backend

(a) The scoring kernel (kernels/paged_decode.py, 2048 keys a grid step, one DMA a page) over the same keys
at page sizes 64-512, with the pool's fp8 keys and with their values as bf16 keys (no fp8 decode in the
kernel): what the page count costs beside what the decode costs. (b) paged_cache.lookup_pages, the page
ids of 2048 selected positions a row, by a take_along_axis and by the one-hot dot (backend.py's
page_lookup), 20 lookups in one program (the per-call floor out of the figure). Medians of --iters
calls, alternating; a trivial jitted call's time (the host's per-call floor, inside every figure of (a)).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench  # noqa: E402  (benchmarks/decode.py: time_variants)

from MaxText.inference import paged_cache  # noqa: E402
from MaxText.kernels import backend  # noqa: E402
from MaxText.kernels import paged_decode as pd  # noqa: E402

H, D, K = 64, 128, 2048  # indexer heads and dim (the official shapes), selected positions a row


def _median_ms(fns: dict, iters: int) -> dict:
  """{name: median ms} of decode.time_variants' alternating calls."""
  times, _ = bench.time_variants(fns, iters)
  return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def scoring(rows: int, context: int, pages: list[int], iters: int, interpret: bool) -> dict:
  k = jax.random.split(jax.random.key(0), 5)
  n = rows * context
  sign = jnp.where(jax.random.bernoulli(k[0], 0.5, (n, D)), 0, 128).astype(jnp.uint8)
  codes = sign + jax.random.randint(k[1], (n, D), 0, 127, jnp.uint8)  # any finite e4m3 (not 0x7f/0xff)
  pools = {"fp8": codes, "bf16": pd.e4m3_to_f32(codes).astype(jnp.bfloat16)}
  scale = jax.random.uniform(k[2], (n, 1), minval=0.5, maxval=1.5) * 3 / 448
  q, w = pd.fp8_scored_queries(jax.random.normal(k[3], (rows, H, D)),
                               pd.index_weights(jax.random.uniform(k[4], (rows, H)) * H ** -0.5, D))
  pos = jnp.full((rows,), context - 1, jnp.int32)
  fns = {}
  for page in pages:
    table = jax.random.permutation(jax.random.fold_in(k[0], page), n // page).reshape(rows, -1).astype(jnp.int32)
    fn = jax.jit(functools.partial(pd.paged_index_scores, page=page, pages_per_block=max(1, K // page),
                                   interpret=interpret))
    for name, keys in pools.items():
      args = (q, None, w, keys, scale, table, pos)
      fns[f"{name}@{page}"] = lambda fn=fn, args=args: fn(*args)
  return _median_ms(fns, iters)


def lookup(rows: int, context: int, pages: list[int], iters: int) -> dict:
  out, same = {}, {}
  for page in pages:
    p = context // page
    table = jax.random.permutation(jax.random.key(page), rows * p).reshape(rows, p).astype(jnp.int32)
    idx = jax.random.randint(jax.random.key(page + 1), (rows, K), 0, context) // page  # [rows, K] page indices
    fns = {}
    for choice in ("gather", "onehot"):
      with backend.forced(page_lookup=choice):  # traced here: each its own fresh function
        fn = jax.jit(lambda t, i: sum(paged_cache.lookup_pages(t, (i + r) % p) for r in range(20)))
        jax.block_until_ready(fn(table, idx))
      fns[f"{choice}@{page}"] = lambda fn=fn: fn(table, idx)
    got = {n: fn() for n, fn in fns.items()}
    same[page] = bool(jnp.all(got[f"gather@{page}"] == got[f"onehot@{page}"]))
    out.update({n: v / 20 for n, v in _median_ms(fns, iters).items()})
  return out, same


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--context", type=int, default=131072)
  ap.add_argument("--pages", type=int, nargs="+", default=[64, 128, 256, 512])
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (any backend; slow)")
  args = ap.parse_args(argv)
  trivial = jax.jit(lambda x: x + 1)
  floor = _median_ms({"trivial": lambda: trivial(jnp.zeros((8, 128)))}, 20)["trivial"]
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); {args.rows} rows x {args.context}; "
        f"median of {args.iters}; a trivial call {floor:.3f} ms")
  score = scoring(args.rows, args.context, args.pages, args.iters, args.interpret)
  look, same = lookup(args.rows, args.context, args.pages, args.iters)
  print(f"{'page':>6} {'fp8 keys ms':>12} {'bf16 keys ms':>13} {'lookup gather ms':>17} {'lookup onehot ms':>17} "
        f"{'equal':>6}")
  for page in args.pages:
    print(f"{page:>6} {score[f'fp8@{page}']:>12.3f} {score[f'bf16@{page}']:>13.3f} {look[f'gather@{page}']:>17.4f} "
          f"{look[f'onehot@{page}']:>17.4f} {str(same[page]):>6}")
  print(json.dumps(dict(benchmark="scoring_pages", backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                        rows=args.rows, context=args.context, trivial_call_ms=round(floor, 4),
                        scoring_ms={k: round(v, 4) for k, v in score.items()},
                        lookup_ms={k: round(v, 4) for k, v in look.items()}, lookup_equal=same)))


if __name__ == "__main__":
  main()
