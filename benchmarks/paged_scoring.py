"""The indexer's scoring + top-k of one decode step over paged keys, three ways side by side: the
contiguous cache's ContiguousKeys (keys stored [b, d, S], one batched matmul), the paged pool's
PagedKeys (a block of whole pages at a time, one row at a time, 2-D dots: what the engine runs),
and the block loop PagedKeys ran before (all rows' block at once through index_scores' batched dot,
blocks of KEY_BLOCK_BYTES / b; kept here as the reference it replaced).

    python benchmarks/paged_scoring.py                       # 16K .. 128K, batch 1, 64 heads of 128
    python benchmarks/paged_scoring.py --contexts 32768 --batch 4
    python benchmarks/paged_scoring.py --block-bytes 1048576 16777216   # the block size (KEY_BLOCK_BYTES)
    python benchmarks/paged_scoring.py --contexts 131072 --batch 4 --short-context 4096   # one long row, 3 short

The pool's pages are a random permutation (a fragmented pool); each row's query sits at its last
position (--short-context N: every row but the first at position N - 1, as a batch whose table is as wide as its
longest row; PagedKeys reads no block past a row's position, the others score every slot). The variants alternate call by call; ms are medians of --iters calls, ratios are to the
contiguous one; each paged variant runs at each --block-bytes. Every variant's selection is checked equal to the contiguous one's (as sets).
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

from MaxText.inference import paged_cache, paged_pools
from MaxText.kernels.cached_attention import ContiguousKeys
from MaxText.kernels.index_scores import index_scores


def batched_blocks(keys: paged_cache.PagedKeys, q, w, pos, head_chunk: int):
  """The block loop before: blocks of KEY_BLOCK_BYTES of fp32 keys over all b rows ([b, width, d]
  gathered), scored by index_scores' batched dot. -> [b,tq,S]."""
  (b, p), d, page = keys.table.shape, keys.idx_k.shape[-1], keys.page_size
  per_block = max(1, min(p, paged_cache.KEY_BLOCK_BYTES // (b * page * d * 4)))
  n, width = -(-p // per_block), per_block * page
  table = jnp.pad(keys.table, ((0, 0), (0, n * per_block - p)))  # [b, n*per_block]

  def block(i, out):
    pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)  # [b,per_block]
    k = paged_pools.page_values(keys.idx_k, pages, page)  # [b,width,d]
    valid = (i * width + jnp.arange(width))[None, None, :] <= pos[:, :, None]  # [b,tq,width]
    return jax.lax.dynamic_update_slice_in_dim(out, index_scores(q, w, k, valid, head_chunk=head_chunk), i * width, 2)

  return jax.lax.fori_loop(0, n, block, jnp.full((b, q.shape[1], n * width), -jnp.inf))[..., :keys.slots]


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
  ap.add_argument("--block-bytes", type=int, nargs="+", default=[paged_cache.KEY_BLOCK_BYTES],
                  help="paged_cache.KEY_BLOCK_BYTES values to time (one paged and one before column each)")
  args = ap.parse_args()
  b, h, d, page = args.batch, args.heads, args.dim, args.page
  rows = []
  print(f"indexer scoring + top-{args.topk} of one decode step; backend {jax.default_backend()}, batch {b}, "
        f"{h} heads of {d}, pages of {page}; median of {args.iters}; ratios to the contiguous cache"
        + (f"; rows after the first at {args.short_context}" if args.short_context else ""))
  names = ["contiguous"] + [f"{v}@{kb >> 10}K" for kb in args.block_bytes for v in ("paged", "before")]
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

    def under(block_bytes, fn):  # fn traced with KEY_BLOCK_BYTES = block_bytes
      def traced(*a):
        old, paged_cache.KEY_BLOCK_BYTES = paged_cache.KEY_BLOCK_BYTES, block_bytes
        try:
          return fn(*a)
        finally:
          paged_cache.KEY_BLOCK_BYTES = old
      return jax.jit(traced)

    call = {"contiguous": jax.jit(lambda k, t, q, w, pos: top(ContiguousKeys(jnp.swapaxes(k, 1, 2)).scores(
        q, w, pos, head_chunk=h)))}
    for kb in args.block_bytes:
      call[f"paged@{kb >> 10}K"] = under(kb, lambda k, t, q, w, pos: top(paged_cache.PagedKeys(k, None, t, page).scores(
          q, w, pos, head_chunk=h)))
      call[f"before@{kb >> 10}K"] = under(kb, lambda k, t, q, w, pos: top(batched_blocks(
          paged_cache.PagedKeys(k, None, t, page), q, w, pos, h)))
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
                    "topk": args.topk, "page": page, "iters": args.iters, "block_bytes": args.block_bytes,
                    "short_context": args.short_context, "rows": rows}))


if __name__ == "__main__":
  main()
