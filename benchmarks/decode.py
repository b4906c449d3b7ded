"""Decode step time vs context length: sparse (indexer + top-k + gather over k latents) vs dense
(absorbed attention over the whole latent cache).

    python benchmarks/decode.py                              # 4K .. 128K, 1 layer, batch 1, fp32
    python benchmarks/decode.py --contexts 4096 16384 --layers 2 --cache-dtype fp8

The model is tiny but wide: the official 671B attention shapes (128 heads, kv_lora 512, rope 64,
nope/v 128, q_lora 1536, 64 indexer heads of 128, top-k 2048) with a narrow residual stream,
1 dense layer and a 512-token vocabulary, so attention dominates a step as it does in the full
model and a 128K cache (704 fp32 numbers per token per layer, 369 MB) fits in memory. The serving
engine's paged pools hold one sequence of each context (S = max_target_length = context), filled
with random latents; one decode step of the engine (its step and write programs: one row at the
last position, its write dropped so every call sees the same cache) is timed: the best of --iters
calls after a warm-up (the least disturbed by other work on a shared machine; --stat median for the
median). Both columns run the same ServingEngine, attention="sparse" or "dense". Prints a table,
then one JSON line (the rows); asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.config import pyconfig
from MaxText.inference import kv_cache, step_feed  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.runtime import sharding

WIDE = dict(  # official attention dims, narrow everything else
    model_name="default", vocab_size=512, emb_dim=1024, mlp_dim=1024, first_num_dense_layers=1,
    num_query_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, indexer_n_heads=64, indexer_head_dim=128, indexer_topk=2048, use_indexer=True,
    rope_factor=40.0, original_max_position_embeddings=4096, max_position_embeddings=163840,
    num_experts=8, num_experts_per_tok=2, n_routing_groups=4, topk_routing_group=2, moe_mlp_dim=256,
    mtp_num_layers=0, ici_data_parallelism=1,
)
PAGE = 64


def config_for(context: int, args):
  return pyconfig.initialize(["bench", "base.yml"], num_devices=1, num_decoder_layers=args.layers,
                             max_target_length=context, max_prefill_length=min(context, 4096),
                             kv_cache_dtype=args.cache_dtype, indexer_use_approx_top_k=args.approx,
                             serve_max_num_seqs=1, serve_page_size=PAGE, serve_num_pages=-(-context // PAGE),
                             indexer_topk=args.topk, **{k: v for k, v in WIDE.items() if k != "indexer_topk"})


def fill_pools(engine: ServingEngine, seed: int) -> None:
  """Every slot of the engine's pools random (normal latents; fp8 fields with unit scales)."""
  key = jax.random.key(seed)

  def fill(pool, key):  # a stacked PagedLayerCache [L,N,..] or a list of per-layer ones [N,..]
    if isinstance(pool, list):
      return [fill(p, jax.random.fold_in(key, i)) for i, p in enumerate(pool)]
    return type(pool)(*[None if a is None else jnp.ones_like(a) if name.endswith("_scale") else
                        jax.random.normal(jax.random.fold_in(key, i), a.shape).astype(a.dtype)
                        for i, (name, a) in enumerate(pool._asdict().items())])

  engine.pools = {name: jax.jit(fill)(p, jax.random.fold_in(key, i)) for i, (name, p) in enumerate(engine.pools.items())}


def time_step(engine: ServingEngine, iters: int, stat: str) -> float:
  """One decode step of one row at the pools' last position (its write dropped: the cache stays)."""
  s = engine.pages_per_seq * engine.page_size
  feed = step_feed.empty(1, 1, engine.pages_per_seq)  # one row, temperature 0, its write dropped (write_pos -1)
  feed["tokens"][0, 0], feed["positions"][0, 0], feed["draw_at"][0] = 1, s - 1, s
  feed["table"][0] = np.arange(engine.pages_per_seq, dtype=np.int32)
  args = (1, feed)
  for _ in range(2):  # compile + warm-up
    engine.pools, nxt = engine._run(*args)
  jax.block_until_ready(nxt)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    engine.pools, nxt = engine._run(*args)
    jax.block_until_ready(nxt)
    times.append(time.perf_counter() - t0)
  return (min(times) if stat == "min" else statistics.median(times)) * 1e3


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 8192, 16384, 32768, 65536, 131072])
  ap.add_argument("--layers", type=int, default=1)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--cache-dtype", default="float32", choices=["float32", "bfloat16", "fp8"])
  ap.add_argument("--approx", action="store_true", help="indexer_use_approx_top_k=true")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--stat", default="min", choices=["min", "median"])
  args = ap.parse_args()

  cfg0 = config_for(args.contexts[0], args)
  mesh = sharding.create_mesh(cfg0)
  _, params, buffers, _ = model_state.create(cfg0, mesh)  # parameters do not depend on the context
  print(f"backend {jax.default_backend()} ({os.cpu_count()} cpus); {args.layers} layer(s), batch 1, "
        f"{model_state.count_params(params) / 1e6:.0f}M parameters; top-k {args.topk}"
        f"{' (approx)' if args.approx else ' (exact)'}; {kv_cache.describe(cfg0).split(';')[0]}; "
        f"{args.stat} of {args.iters} steps")
  print(f"{'context':>8} {'sparse ms':>10} {'dense ms':>10} {'dense/sparse':>13}")
  rows = []
  for s in args.contexts:
    cfg = config_for(s, args)
    graphdef, _, _ = model_state.abstract_model(cfg)
    row = {}
    for mode in ("sparse", "dense"):
      engine = ServingEngine(cfg, graphdef, params, buffers, attention=mode)
      fill_pools(engine, seed=s)
      row[mode] = time_step(engine, args.iters, args.stat)
      del engine
    print(f"{s:>8} {row['sparse']:>10.1f} {row['dense']:>10.1f} {row['dense'] / row['sparse']:>12.1f}x", flush=True)
    rows.append(dict(context=s, sparse_ms=round(row["sparse"], 3), dense_ms=round(row["dense"], 3)))
  print(json.dumps(dict(benchmark="decode", backend=jax.default_backend(), layers=args.layers, topk=args.topk,
                        cache_dtype=args.cache_dtype, approx=args.approx, stat=args.stat, rows=rows)))


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
