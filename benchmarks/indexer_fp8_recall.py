"""Recall of the indexer's top-k under fp8 keys and queries against fp32 scoring, with and without the
Hadamard rotation (indexer_hadamard), on synthetic vectors.

    python benchmarks/indexer_fp8_recall.py                       # 32K keys, 8 queries, k = 2048
    python benchmarks/indexer_fp8_recall.py --keys 131072 --outlier 30

128-dim Gaussian vectors with log-normal channel scales and a few channels --outlier times larger, 64 heads.
Prints recall = |top-k(variant) & top-k(fp32)| / k per variant (fp8 keys; fp8 keys and queries; each with and
without the rotation), then one JSON line.
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
QUERIES, OUTLIERS = 8, 4  # queries scored; channels --outlier times larger
VARIANTS = ("fp8_keys", "fp8_keys_and_queries")  # the fp8 operands, each with rotation none | hadamard


def vectors(key, n: int, channels: jax.Array, shape) -> jax.Array:
  """[n, *shape, D] Gaussian vectors times per-channel scales (channels [D])."""
  return jax.random.normal(key, (n, *shape, D)) * channels


def scores(q, q_scale, w, k, k_scale, pos=None) -> jax.Array:
  """[n, S] indexer scores sum_h w relu(q.k): query row i (q [n,H,d], w [n,H] already times d**-0.5:
  pd.index_weights) over the keys k [S,d] (one page of S slots, as stored: f32, or fp8 bits with
  k_scale [S,1]); slots past pos[i] (default S - 1: every key) score -inf."""
  n, s = q.shape[0], k.shape[0]
  pos = jnp.full((n,), s - 1, jnp.int32) if pos is None else pos
  return pd.paged_index_scores_xla(q, q_scale, w, k, k_scale, jnp.zeros((n, 1), jnp.int32), pos, s)  # [n,S]


def topk_mask(x: jax.Array, k: int) -> jax.Array:
  """x [n,S] -> bool [n,S]: each row's top-k (lax.top_k's set: ties lowest position first)."""
  idx = jax.lax.top_k(x, k)[1]  # [n,k]
  return jnp.zeros(x.shape, bool).at[jnp.arange(x.shape[0])[:, None], idx].set(True)


def recall(got: jax.Array, ref: jax.Array, k: int) -> float:
  """Mean over rows of |top-k(got) & top-k(ref)| / k; got, ref [n,S]."""
  return float(jnp.mean(jnp.sum(topk_mask(got, k) & topk_mask(ref, k), axis=-1)) / k)


def fp8_variants(q: jax.Array, w: jax.Array, k: jax.Array, rotate: bool, pos=None) -> dict[str, jax.Array]:
  """The fp8 variants' scores [n,S] of queries q [n,H,d] (weights w [n,H]) over keys k [S,d], after the
  Hadamard rotation when `rotate` (as indexer_hadamard applies it: x @ H after RoPE)."""
  hm = jnp.asarray(hadamard_matrix(k.shape[-1])) if rotate else jnp.eye(k.shape[-1])
  kr, qr = k @ hm, q @ hm  # [S,d], [n,H,d]; orthogonal: fp32 scores unchanged
  kq, kscale = quantize_fp8(kr)  # e4m3 [S,d], one scale per 128-block [S,1]
  kbits = jax.lax.bitcast_convert_type(kq, jnp.uint8)
  q8, qs = pd.fp8_queries(qr)  # [n,H,d] bits, [n,H]
  return {"fp8_keys": scores(qr, None, w, kbits, kscale, pos), "fp8_keys_and_queries": scores(q8, qs, w, kbits, kscale, pos)}


def synthetic(args) -> None:
  ks = jax.random.split(jax.random.key(0), 5)
  channels = jnp.exp(0.5 * jax.random.normal(ks[0], (D,)))  # log-normal channel scales
  channels = channels.at[:OUTLIERS].multiply(args.outlier)
  k = vectors(ks[1], args.keys, channels, ())  # [S, D]
  q = vectors(ks[2], QUERIES, channels, (H,))  # [n, H, D]
  w = jax.random.uniform(ks[3], (QUERIES, H)) * H ** -0.5 * D ** -0.5
  ref = scores(q, None, w, k, None)
  topk = args.topk
  rows = []
  print(f"{args.keys} keys, {QUERIES} queries, k = {topk}; synthetic vectors, {OUTLIERS} outlier "
        f"channels x{args.outlier}")
  print(f"{'rotation':>9} {'fp8 keys':>9} {'fp8 keys + queries':>19}")
  for rotate in (False, True):
    got = fp8_variants(q, w, k, rotate)
    r = {v: recall(got[v], ref, topk) for v in VARIANTS}
    name = "hadamard" if rotate else "none"
    rows.append(dict(rotation=name, **{v: round(r[v], 4) for v in VARIANTS}))
    print(f"{name:>9} {r['fp8_keys']:>9.4f} {r['fp8_keys_and_queries']:>19.4f}")
  print(json.dumps(dict(benchmark="indexer_fp8_recall", keys=args.keys, queries=QUERIES, topk=topk,
                        outlier=args.outlier, outliers=OUTLIERS, data="synthetic", rows=rows)))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--keys", type=int, default=32768)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--outlier", type=float, default=20.0, help="how much larger the outlier channels are")
  synthetic(ap.parse_args(argv))


if __name__ == "__main__":
  main()
