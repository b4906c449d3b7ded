"""What the fp8 cache costs in a decode step, against an f32 cache of the same shapes, in one process:
the indexer's scoring and the selected latents' gather alone, and the engine's sparse and dense steps.

    python benchmarks/decode_fp8.py --context 131072 --rows 4 --iters 5          # issue 54's CPU case
    python benchmarks/decode_fp8.py --context 8192 --rows 2 --iters 3 --no-dense  # a smoke run (~1 min)

1. pieces, on layer 0's pools of benchmarks/decode.py's model (--rows rows of --context, pages a random
   permutation of the pool's): the indexer's scores of one decode query a row over every cached key
   (paged_cache.PagedKeys.scores, the "xla" page-block loop) over the fp8 pool as the library scores it
   (each block's codes decoded and scored, each key's score then times its scale), over the fp8 pool
   dequantized first (each block's [width, d] keys times their scales, then scored: the loop before
   2026-12-06, kept here as the comparison) and over an f32 pool of the same shape (no decode, 4x the
   bytes); with the engine's fp8 queries (paged_decode.fp8_scored_queries: bf16 e4m3 values) the library's
   bf16 x bf16 dot beside the fp32 dot of the same codes (the loop before 2026-12-06 19:20 UTC); the gather of the k selected latents (paged_cache.gather_selected, fp8 dequantized) likewise.
2. steps (--no-steps skips them): the engine's decode step (step + write programs, benchmarks/decode.py's
   paged_step) sparse and dense (--no-dense: sparse only) over fp8 and over f32 pools; dense/sparse per
   cache dtype.

Every variant of a section is called in turn, call i of each back to back (so a disturbance on a shared
host hits all alike), after a compile + warm-up call: the median of --iters calls, of wall time and of
this process's CPU time (on a host shared with other jobs CPU time says what the work costs, wall
time what the caller waited). Prints the tables, then one JSON line; asserts nothing about time.
(The e4m3 decode itself, XLA's convert against integer ops and a 256-entry table, was measured here
and cost the same: docs/kernels.md, On the CPU; the library keeps the convert.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench  # noqa: E402  (benchmarks/decode.py: the model, the pools and the step)

from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.inference import kv_cache, paged_cache, paged_pools  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.kernels import backend, paged_decode  # noqa: E402
from MaxText.runtime import sharding  # noqa: E402


class DequantizedFirst(paged_cache.PagedKeys):
  """PagedKeys scoring fp8 keys dequantized first (the loop before 2026-12-06): the comparison for section 1."""

  def block_keys(self, pages):
    keys = paged_pools.page_values(self.idx_k, pages, self.page_size)[0]  # [width,d] codes
    return kv_cache.dequantize_fp8(keys, paged_pools.page_values(self.idx_k_scale, pages, self.page_size)[0]), None


class CodesAsF32(paged_cache.PagedKeys):
  """PagedKeys with each block's fp8 codes decoded to f32 (before 2026-12-06: row_index_scores' fp32 dot even
  with fp8 (bf16) queries), the comparison for the library's bf16 x bf16 dot with fp32 accumulation."""

  def block_keys(self, pages):
    keys, scale = super().block_keys(pages)
    return keys.astype(jnp.float32), scale


def timed(fns: dict, iters: int) -> tuple[dict, dict]:
  """({name: (median wall ms, median cpu ms)}, {name: first output}) of fns () -> array, called in turn."""
  first = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}
  for fn in fns.values():
    jax.block_until_ready(fn())
  got = {name: ([], []) for name in fns}
  for _ in range(iters):
    for name, fn in fns.items():
      c0, t0 = time.process_time(), time.perf_counter()
      jax.block_until_ready(fn())
      got[name][0].append(time.perf_counter() - t0)
      got[name][1].append(time.process_time() - c0)
  return {name: (statistics.median(w) * 1e3, statistics.median(c) * 1e3) for name, (w, c) in got.items()}, first


def traced(fn, *args):
  """A fresh jit of fn, compiled and run once here."""
  f = jax.jit(lambda *a: fn(*a))
  jax.block_until_ready(f(*args))
  return lambda: f(*args)


def print_rows(title: str, rows: list[dict], base: str | None = None) -> None:
  print(f"\n{title:>44} {'wall ms':>10} {'cpu ms':>10}" + (f" {'cpu / ' + base:>14}" if base else ""))
  ref = next((r for r in rows if r["variant"] == base), None)
  for r in rows:
    tail = f" {r['cpu_ms'] / ref['cpu_ms']:>14.3f}" if ref else ""
    print(f"{r['variant']:>44} {r['wall_ms']:>10.1f} {r['cpu_ms']:>10.1f}{tail}", flush=True)


def rows_of(times: dict, **extra) -> list[dict]:
  return [dict(variant=name, wall_ms=round(w, 3), cpu_ms=round(c, 3), **extra) for name, (w, c) in times.items()]


def layer_pool(engine: ServingEngine) -> paged_pools.PagedLayerCache:
  pool = next(iter(engine.pools.values()))
  return pool[0] if isinstance(pool, list) else jax.tree.map(lambda a: a[0], pool)


def pieces_section(engines: dict, feed: dict, args) -> list[dict]:
  """1: PagedKeys.scores and gather_selected on layer 0's fp8 pool and f32 pool."""
  table = jnp.asarray(feed["table"])  # [B,P]
  cfg = engines["fp8"].config
  b, h, d = table.shape[0], cfg.indexer_n_heads, cfg.indexer_head_dim
  key = jax.random.key(0)
  q = jax.random.normal(key, (b, 1, h, d), jnp.float32)  # [B,1,H,d]
  w = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, h), jnp.float32) * h ** -0.5  # [B,1,H]
  pos = jnp.asarray(feed["positions"][:, :1])  # [B,1]
  page = engines["fp8"].page_size
  k = min(cfg.indexer_topk, table.shape[1] * page)
  idx = jnp.asarray(np.sort(np.random.default_rng(1).permutation(table.shape[1] * page)[:k]))[None].repeat(b, 0)  # [B,k]
  pools = {dt: layer_pool(e) for dt, e in engines.items()}

  def scores(pool, keys=paged_cache.PagedKeys):
    src = keys(pool.idx_k, pool.idx_k_scale, table, page)
    return lambda q, w, pos: src.scores(q, w, pos, head_chunk=h)

  def gather(pool):
    return lambda idx: paged_cache.gather_selected(pool, table, idx, page)[0]

  q8, w8 = paged_decode.fp8_scored_queries(q, w)  # the engine's queries with an fp8 cache: e4m3 values as bf16
  rows = []
  with backend.forced(paged_scoring="xla"):  # the XLA page-block loop (the CPU's row), whatever the backend
    fns = {"fp8 queries: bf16 dot": traced(scores(pools["fp8"]), q8, w8, pos),
           "fp8 queries: f32 dot": traced(scores(pools["fp8"], CodesAsF32), q8, w8, pos),
           "fp8": traced(scores(pools["fp8"]), q, w, pos),
           "fp8, dequantized first": traced(scores(pools["fp8"], DequantizedFirst), q, w, pos),
           "float32 pool": traced(scores(pools["float32"]), q, w, pos)}
  times, out = timed(fns, args.iters)
  ref, got = np.asarray(out["fp8, dequantized first"]), np.asarray(out["fp8"])
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
  fin = np.isfinite(ref)
  err = float(np.max(np.abs(got[fin] - ref[fin])) / np.max(np.abs(ref[fin])))  # fp32 rounding apart
  part = rows_of(times, piece="scores", max_rel_diff=err)
  print_rows(f"scores ({b} rows x {table.shape[1] * page} slots)", part, "fp8, dequantized first")
  print(f"{'fp8 vs dequantized first: max |diff| / max |score|':>44} {err:.1e}")
  ref8, got8 = np.asarray(out["fp8 queries: f32 dot"]), np.asarray(out["fp8 queries: bf16 dot"])
  np.testing.assert_array_equal(np.isfinite(got8), np.isfinite(ref8))
  err8 = float(np.max(np.abs(got8[fin] - ref8[fin])) / np.max(np.abs(ref8[fin])))  # the fp32 sums' order apart
  print(f"{'fp8 queries, bf16 vs f32 dot: max rel diff':>44} {err8:.1e}")
  for r in part:
    r["max_rel_diff"] = err8 if r["variant"].startswith("fp8 queries") else err
  rows += part
  times, _ = timed({"fp8": traced(gather(pools["fp8"]), idx), "float32 pool": traced(gather(pools["float32"]), idx)},
                   args.iters)
  part = rows_of(times, piece="gather_selected")
  print_rows(f"gather_selected ({b} rows x {table.shape[1] * page} slots)", part, "fp8")
  return rows + part


def steps_section(cfgs: dict, graphdef, params, buffers, feed: dict, args) -> list[dict]:
  """2: the engine's decode step, sparse and dense, over fp8 and f32 pools, in turn."""
  fns = {}
  modes = ("sparse",) if args.no_dense else ("sparse", "dense")
  for mode in modes:
    for dt, cfg in cfgs.items():
      engine = ServingEngine(cfg, graphdef, params, buffers, attention=mode)
      bench.fill_pools(engine, seed=args.context)
      run = bench.paged_step(engine, feed)
      jax.block_until_ready(run())  # compiled here
      fns[f"{mode}, {dt}"] = run
  times, _ = timed(fns, args.iters)
  rows = rows_of(times)
  print_rows(f"decode step ({args.rows} rows x {args.context})", rows, "sparse, fp8")
  if not args.no_dense:
    for dt in cfgs:
      wall, cpu = (times[f"dense, {dt}"][i] / times[f"sparse, {dt}"][i] for i in (0, 1))
      print(f"{'dense / sparse, ' + dt:>44} {wall:>9.2f}x {cpu:>9.2f}x")
      rows.append(dict(variant=f"dense/sparse, {dt}", ratio=round(wall, 3), cpu_ratio=round(cpu, 3)))
  return rows


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--context", type=int, default=131072)
  ap.add_argument("--rows", type=int, default=4)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--no-steps", action="store_true", help="skip section 2 (the engine's steps)")
  ap.add_argument("--no-dense", action="store_true", help="section 2: the sparse steps only")
  args = ap.parse_args(argv)

  dargs = argparse.Namespace(topk=args.topk, set=[], layers=1, chunk=512, approx=False)
  cfgs = {dt: bench.config_for(args.context, argparse.Namespace(**vars(dargs), cache_dtype=dt), args.rows)
          for dt in ("fp8", "float32")}
  mesh = sharding.create_mesh(cfgs["fp8"])
  graphdef, params, buffers, _ = model_state.create(cfgs["fp8"], mesh)  # the parameters do not depend on the cache
  print(f"backend {jax.default_backend()} ({os.cpu_count()} cpus); {args.rows} rows x {args.context}; median of "
        f"{args.iters} calls; load average {os.getloadavg()[0]:.1f}")
  result = dict(benchmark="decode_fp8", backend=jax.default_backend(), rows=args.rows, context=args.context,
                iters=args.iters, load_average=round(os.getloadavg()[0], 1))
  engines = {dt: ServingEngine(cfg, graphdef, params, buffers) for dt, cfg in cfgs.items()}
  for dt, e in engines.items():
    bench.fill_pools(e, seed=args.context)
  feed = bench.step_feed_at_end(engines["fp8"], args.rows, 1)
  result["pieces"] = pieces_section(engines, feed, args)
  del engines
  if not args.no_steps:
    result["steps"] = steps_section(cfgs, graphdef, params, buffers, feed, args)
  result["load_average_end"] = round(os.getloadavg()[0], 1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
