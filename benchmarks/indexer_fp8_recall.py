"""Recall of the indexer's top-k under fp8 keys and queries against fp32 scoring, with and without the
Hadamard rotation (indexer_hadamard).

    python benchmarks/indexer_fp8_recall.py                       # 32K keys, 8 queries, k = 2048
    python benchmarks/indexer_fp8_recall.py --keys 131072 --outlier 30

The keys and queries are SYNTHETIC (no trained model's cache could be made here in the time): 128-dim
Gaussian vectors whose channels carry log-normal scales and a few outlier channels --outlier times
larger (the shape of LayerNorm'd activations that makes per-block fp8 lossy: one outlier sets the
block's scale and the small channels round to few levels), 64 heads, positive head weights. Scores
are the indexer's sum_h w relu(q.k) (kernels/paged_decode.paged_index_scores_xla). Variants:
fp8 keys (e4m3, one scale per 128-block: the fp8 cache today) with fp32 queries; fp8 keys and fp8
queries (one scale per head: paged_decode.fp8_queries, as DeepSeek's release scores in fp8); each
with the vectors as they are and after the Hadamard rotation (orthogonal: the fp32 scores are
unchanged, the outliers spread over all channels). Recall = |top-k(variant) & top-k(fp32)| / k, the
mean over queries. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from MaxText.inference.kv_cache import quantize_fp8
from MaxText.kernels import paged_decode as pd
from MaxText.layers.indexer import hadamard_matrix

H, D = 64, 128


def vectors(key, n: int, channels: jax.Array, shape) -> jax.Array:
  """[n, *shape, D] Gaussian vectors times per-channel scales (channels [D])."""
  return jax.random.normal(key, (n, *shape, D)) * channels


def scores(q, q_scale, w, k, k_scale) -> jax.Array:
  """[n_q, S] indexer scores: one query per row over all S keys (one page of S slots)."""
  n = q.shape[0]
  s = k.shape[0]
  table = jnp.zeros((1, 1), jnp.int32)
  one = lambda qi, qsi, wi: pd.paged_index_scores_xla(qi[None], None if qsi is None else qsi[None], wi[None], k,
                                                      k_scale, table, jnp.array([s - 1]), s)[0]
  return jnp.stack([one(q[i], None if q_scale is None else q_scale[i], w[i]) for i in range(n)])  # [n_q, S]


def recall(got: jax.Array, ref: jax.Array, k: int) -> float:
  top = lambda x: jax.lax.top_k(x, k)[1]
  hit = jax.vmap(lambda a, b: jnp.sum(jnp.isin(a, b)))(top(got), top(ref))
  return float(jnp.mean(hit) / k)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--keys", type=int, default=32768)
  ap.add_argument("--queries", type=int, default=8)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--outlier", type=float, default=20.0, help="how much larger the outlier channels are")
  ap.add_argument("--outliers", type=int, default=4, help="how many outlier channels")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  ks = jax.random.split(jax.random.key(args.seed), 5)
  channels = jnp.exp(0.5 * jax.random.normal(ks[0], (D,)))  # log-normal channel scales
  channels = channels.at[:args.outliers].multiply(args.outlier)
  k = vectors(ks[1], args.keys, channels, ())  # [S, D]
  q = vectors(ks[2], args.queries, channels, (H,))  # [n, H, D]
  w = jax.random.uniform(ks[3], (args.queries, H)) * H ** -0.5 * D ** -0.5
  ref = scores(q, None, w, k, None)
  rows = []
  print(f"{args.keys} keys, {args.queries} queries, k = {args.topk}; synthetic vectors, {args.outliers} outlier "
        f"channels x{args.outlier}")
  print(f"{'rotation':>9} {'fp8 keys':>9} {'fp8 keys + queries':>19}")
  for rotate in (False, True):
    hm = jnp.asarray(hadamard_matrix(D)) if rotate else jnp.eye(D)
    kr, qr = k @ hm, q @ hm  # orthogonal: fp32 scores unchanged
    kq, kscale = quantize_fp8(kr)
    kbits = jax.lax.bitcast_convert_type(kq, jnp.uint8)
    r_keys = recall(scores(qr, None, w, kbits, kscale), ref, args.topk)
    q8, qs = pd.fp8_queries(qr)
    r_both = recall(scores(q8, qs, w, kbits, kscale), ref, args.topk)
    name = "hadamard" if rotate else "none"
    rows.append(dict(rotation=name, fp8_keys=round(r_keys, 4), fp8_keys_and_queries=round(r_both, 4)))
    print(f"{name:>9} {r_keys:>9.4f} {r_both:>19.4f}")
  print(json.dumps(dict(benchmark="indexer_fp8_recall", keys=args.keys, queries=args.queries, topk=args.topk,
                        outlier=args.outlier, outliers=args.outliers, data="synthetic", rows=rows)))


if __name__ == "__main__":
  main()
