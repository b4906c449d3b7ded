"""The indexer's scoring + top-k of one decode step over paged keys, three ways side by side: the
contiguous cache's ContiguousKeys (keys stored [b, d, S], one batched matmul), the paged pool's
PagedKeys (a block of whole pages at a time, one row at a time, 2-D dots: what the engine runs),
and the block loop PagedKeys ran before (all rows' block at once through index_scores' batched dot,
blocks of KEY_BLOCK_BYTES / b; kept here as the reference it replaced).

    python benchmarks/paged_scoring.py                       # 16K .. 128K, batch 1, 64 heads of 128
    python benchmarks/paged_scoring.py --contexts 32768 --batch 4

The pool's pages are a random permutation (a fragmented pool); each row's query sits at its last
position. The variants alternate call by call; ms are medians of --iters calls, ratios are to the
contiguous one. Every variant's selection is checked equal to the contiguous one's (as sets).
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
    k = paged_cache._pages(keys.idx_k, pages, page)  # [b,width,d]
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
  args = ap.parse_args()
  b, h, d, page = args.batch, args.heads, args.dim, args.page
  rows = []
  print(f"indexer scoring + top-{args.topk} of one decode step; backend {jax.default_backend()}, batch {b}, "
        f"{h} heads of {d}, pages of {page}; median of {args.iters}")
  print(f"{'context':>8} {'contiguous ms':>14} {'paged ms':>10} {'p/c':>6} {'before ms':>10} {'b/c':>6}")
  for s in args.contexts:
    rng = np.random.default_rng(s)
    p = s // page
    pool = jnp.asarray(rng.standard_normal((b * s, d), np.float32))  # [N,d]
    table = jnp.asarray(rng.permutation(b * p).astype(np.int32).reshape(b, p))  # [b,P]
    stored = jnp.swapaxes(pool.reshape(b * p, page, d)[table].reshape(b, s, d), 1, 2) + 0  # [b,d,S]
    q = jnp.asarray(rng.standard_normal((b, 1, h, d), np.float32))
    w = jnp.asarray(rng.random((b, 1, h), np.float32))
    pos = jnp.full((b, 1), s - 1, jnp.int32)
    top = lambda x: jnp.sort(jax.lax.top_k(x, args.topk)[1], axis=-1)  # noqa: E731
    fns = {
        "contiguous": (jax.jit(lambda k, t, q, w, pos: top(ContiguousKeys(jnp.swapaxes(k, 1, 2)).scores(
            q, w, pos, head_chunk=h))), stored),
        "paged": (jax.jit(lambda k, t, q, w, pos: top(paged_cache.PagedKeys(k, None, t, page).scores(
            q, w, pos, head_chunk=h))), pool),
        "before": (jax.jit(lambda k, t, q, w, pos: top(batched_blocks(paged_cache.PagedKeys(k, None, t, page),
                                                                      q, w, pos, h))), pool)}
    call = {name: (lambda f=f, k=k: f(k, table, q, w, pos)) for name, (f, k) in fns.items()}
    want = np.asarray(call["contiguous"]())
    same = {name: bool(np.array_equal(np.asarray(c()), want)) for name, c in call.items()}
    times = {name: [] for name in call}
    for _ in range(args.iters):
      for name, c in call.items():
        t0 = time.perf_counter()
        c().block_until_ready()
        times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {name: statistics.median(v) for name, v in times.items()}
    row = {"context": s, **{f"{n}_ms": round(v, 3) for n, v in ms.items()},
           "paged_ratio": round(ms["paged"] / ms["contiguous"], 3),
           "before_ratio": round(ms["before"] / ms["contiguous"], 3), "same_selection": same}
    rows.append(row)
    print(f"{s:>8} {ms['contiguous']:>14.2f} {ms['paged']:>10.2f} {row['paged_ratio']:>5.2f}x "
          f"{ms['before']:>10.2f} {row['before_ratio']:>5.2f}x" + ("" if all(same.values()) else f"  selection differs: {same}"),
          flush=True)
  print(json.dumps({"benchmark": "paged_scoring", "batch": b, "heads": h, "dim": d, "topk": args.topk,
                    "page": page, "iters": args.iters, "rows": rows}))


if __name__ == "__main__":
  main()
