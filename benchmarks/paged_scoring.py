"""The indexer's scoring + top-k of one decode step, paged against contiguous: the contiguous cache's
ContiguousKeys (keys stored [b, d, S], one batched matmul) beside the paged pool's PagedKeys (a block of whole pages
at a time, one row at a time, 2-D dots: what the engine's "xla" route runs).

    python benchmarks/paged_scoring.py                       # 16K .. 128K, batch 1, 64 heads of 128
    python benchmarks/paged_scoring.py --contexts 131072 --batch 4 --short-context 4096   # one long row, 3 short

The pool's pages are a random permutation (a fragmented pool); each row's query sits at its last position
(--short-context N: every row but the first at position N - 1, as a batch whose table is as wide as its longest row;
PagedKeys reads no block past a row's position, the contiguous cache scores every slot). The two alternate call by
call; ms are medians of --iters calls, the ratio paged / contiguous; the selections are checked equal (as sets).
Prints a table, then one JSON line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference import paged_cache
from MaxText.kernels.cached_attention import ContiguousKeys


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=64)
  ap.add_argument("--dim", type=int, default=128)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--page", type=int, default=64)
  ap.add_argument("--iters", type=int, default=15)
  ap.add_argument("--short-context", type=int, default=0, help="rows after the first end at this position + 1 (0: all at the context)")
  args = ap.parse_args()
  b, h, d, page = args.batch, args.heads, args.dim, args.page
  rows = []
  print(f"indexer scoring + top-{args.topk} of one decode step; backend {jax.default_backend()}, batch {b}, "
        f"{h} heads of {d}, pages of {page}; median of {args.iters}; ratios to the contiguous cache"
        + (f"; rows after the first at {args.short_context}" if args.short_context else ""))
  names = ["contiguous", "paged"]
  print(f"{'context':>8} " + " ".join(f"{n + ' ms':>18}" for n in names))
  for s in args.contexts:
    rng = np.random.default_rng(s)
    p = s // page
    pool = jnp.asarray(rng.standard_normal((b * s, d), np.float32))  # [N,d]
    table = jnp.asarray(rng.permutation(b * p).astype(np.int32).reshape(b, p))  # [b,P]
    stored = jnp.swapaxes(pool.reshape(b * p, page, d)[table].reshape(b, s, d), 1, 2) + 0  # [b,d,S]
    q = jnp.asarray(rng.standard_normal((b, 1, h, d), np.float32))
    w = jnp.asarray(rng.random((b, 1, h), np.float32))
    pos = jnp.full((b, 1), s - 1, jnp.int32)
    if args.short_context:
      pos = pos.at[1:].set(min(args.short_context, s) - 1)  # [b,1]: one long row, the rest short
    top = lambda x: jnp.sort(jax.lax.top_k(x, args.topk)[1], axis=-1)  # noqa: E731

    call = {"contiguous": jax.jit(lambda k, t, q, w, pos: top(ContiguousKeys(jnp.swapaxes(k, 1, 2)).scores(
        q, w, pos, head_chunk=h))),
            "paged": jax.jit(lambda k, t, q, w, pos: top(paged_cache.PagedKeys(k, None, t, page).scores(
                q, w, pos, head_chunk=h)))}
    run = {n: (lambda f=f, k=(stored if n == "contiguous" else pool): f(k, table, q, w, pos)) for n, f in call.items()}
    want = np.asarray(run["contiguous"]())
    same = {n: bool(np.array_equal(np.asarray(r()), want)) for n, r in run.items()}
    times = {n: [] for n in run}
    for _ in range(args.iters):
      for n, r in run.items():
        t0 = time.perf_counter()
        r().block_until_ready()
        times[n].append((time.perf_counter() - t0) * 1e3)
    ms = {n: statistics.median(v) for n, v in times.items()}
    row = {"context": s, "ms": {n: round(v, 3) for n, v in ms.items()},
           "ratio": {n: round(v / ms["contiguous"], 3) for n, v in ms.items()}, "same_selection": same}
    rows.append(row)
    print(f"{s:>8} " + " ".join(f"{ms[n]:>10.2f} ({row['ratio'][n]:.2f}x)" for n in names)
          + ("" if all(same.values()) else f"  selection differs: {same}"), flush=True)
  print(json.dumps({"benchmark": "paged_scoring", "backend": jax.default_backend(), "batch": b, "heads": h, "dim": d,
                    "topk": args.topk, "page": page, "iters": args.iters,
                    "short_context": args.short_context, "rows": rows}))


if __name__ == "__main__":
  main()
