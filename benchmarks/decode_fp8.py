"""What the fp8 cache costs in a decode step, against an f32 cache of the same shapes, in one process:
the e4m3 decodes of backend.py's fp8_decode side by side, alone and where the step runs them, and the
engine's sparse and dense steps over fp8 and f32 pools.

    python benchmarks/decode_fp8.py --context 131072 --rows 4 --iters 5          # issue 54's CPU case
    python benchmarks/decode_fp8.py --context 8192 --rows 2 --iters 3 --no-dense  # a smoke run (~1 min)

1. convert: --values e4m3 codes (uint8, as the pools hold them) -> f32 by each fp8_decode way, alone
   (one jitted program each; equal bit for bit, NaN codes included).
2. pieces, on layer 0's pools of benchmarks/decode.py's model (--rows rows of --context, pages a random
   permutation of the pool's): the indexer's scores of one decode query a row over every cached key
   (paged_cache.PagedKeys.scores, the "xla" page-block loop: each block's pages gathered and decoded,
   then scored) under each fp8_decode way, and over an f32 pool of the same shape (the floor: no
   decode, 4x the bytes); the gather of the k selected latents (paged_cache.gather_selected, fp8
   dequantized) likewise.
3. steps (--no-steps skips them): the engine's decode step (step + write programs, benchmarks/decode.py's
   paged_step) sparse and dense (--no-dense: sparse only), over fp8 pools (each fp8_decode way for the
   sparse step; the backend's own for the dense one) and over f32 pools; dense/sparse per cache dtype.

Every variant of a section is called in turn, call i of each back to back (so a disturbance on a shared
host hits all alike), after a compile + warm-up call: the median of --iters calls, of wall time and of
this process's CPU time (on a host shared with other jobs CPU time says what the work costs, wall
time what the caller waited). Prints the tables, then one JSON line; asserts nothing about time.
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
from MaxText.inference import kv_cache, paged_cache  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.kernels import backend  # noqa: E402
from MaxText.runtime import sharding  # noqa: E402

WAYS = backend.KERNELS["fp8_decode"]


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


def traced_under(way: str | None, fn, *args):
  """A fresh jit of fn, traced (its first call) with fp8_decode forced to `way` (None: the backend's)."""
  f = jax.jit(lambda *a: fn(*a))
  if way is None:
    jax.block_until_ready(f(*args))
  else:
    with backend.forced(fp8_decode=way):
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


def convert_section(args) -> list[dict]:
  """1: the decodes alone on --values codes; equal bit for bit (NaN where the code is NaN)."""
  codes = jnp.asarray(np.random.default_rng(0).integers(0, 256, args.values, dtype=np.uint8))
  fns = {f"{way}": traced_under(way, kv_cache.e4m3_values, codes) for way in WAYS}
  times, out = timed(fns, args.iters)
  ref = np.asarray(out[WAYS[0]])
  for way in WAYS:
    np.testing.assert_array_equal(np.asarray(out[way]), ref)  # NaN == NaN here: same positions
  rows = rows_of(times, values=args.values)
  print_rows(f"decode {args.values} e4m3 codes alone", rows, WAYS[0])
  return rows


def layer_pool(engine: ServingEngine) -> paged_cache.PagedLayerCache:
  pool = next(iter(engine.pools.values()))
  return pool[0] if isinstance(pool, list) else jax.tree.map(lambda a: a[0], pool)


def pieces_section(engines: dict, feed: dict, args) -> list[dict]:
  """2: PagedKeys.scores and gather_selected on layer 0's fp8 pool (each way) and f32 pool."""
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

  def scores(pool):
    keys = paged_cache.PagedKeys(pool.idx_k, pool.idx_k_scale, table, page)
    return lambda q, w, pos: keys.scores(q, w, pos, head_chunk=h)

  def gather(pool):
    return lambda idx: paged_cache.gather_selected(pool, table, idx, page)[0]

  rows = []
  for name, make, fargs in (("scores", scores, (q, w, pos)), ("gather_selected", gather, (idx,))):
    pools = {dt: layer_pool(e) for dt, e in engines.items()}
    with backend.forced(paged_scoring="xla"):  # the XLA page-block loop (the CPU's row), whatever the backend
      fns = {f"fp8, {way}": traced_under(way, make(pools["fp8"]), *fargs) for way in WAYS}
      fns["float32 pool"] = traced_under(None, make(pools["float32"]), *fargs)
    times, out = timed(fns, args.iters)
    for way in WAYS[1:]:  # every way decodes to the same values: the same scores, bit for bit
      np.testing.assert_array_equal(np.asarray(out[f"fp8, {way}"]), np.asarray(out[f"fp8, {WAYS[0]}"]))
    part = rows_of(times, piece=name)
    print_rows(f"{name} ({b} rows x {table.shape[1] * page} slots)", part, f"fp8, {WAYS[0]}")
    rows += part
  return rows


def steps_section(cfgs: dict, graphdef, params, buffers, feed: dict, args) -> list[dict]:
  """3: the engine's decode step, sparse (fp8 under each way, f32) and dense (fp8, f32), in turn."""
  fns = {}
  modes = ("sparse",) if args.no_dense else ("sparse", "dense")
  for mode in modes:
    for dt, cfg in cfgs.items():
      for way in (WAYS if dt == "fp8" and mode == "sparse" else (None,)):
        engine = ServingEngine(cfg, graphdef, params, buffers, attention=mode)
        bench.fill_pools(engine, seed=args.context)
        run = bench.paged_step(engine, feed)
        name = f"{mode}, {dt}" + (f", {way}" if way else "")
        with backend.forced(**({"fp8_decode": way} if way else {})):
          jax.block_until_ready(run())  # compiled here, with the way in force
        fns[name] = run
  times, out = timed(fns, args.iters)
  rows = rows_of(times)
  print_rows(f"decode step ({args.rows} rows x {args.context})", rows, f"sparse, fp8, {WAYS[0]}")
  own = backend.choice("fp8_decode")
  for dt in cfgs:
    sparse = f"sparse, {dt}" + (f", {own}" if dt == "fp8" else "")
    if not args.no_dense:
      wall, cpu = (times[f"dense, {dt}"][i] / times[sparse][i] for i in (0, 1))
      print(f"{'dense / sparse, ' + dt:>44} {wall:>9.2f}x {cpu:>9.2f}x")
      rows.append(dict(variant=f"dense/sparse, {dt}", ratio=round(wall, 3), cpu_ratio=round(cpu, 3)))
  return rows


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--context", type=int, default=131072)
  ap.add_argument("--rows", type=int, default=4)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--values", type=int, default=1 << 21, help="codes decoded alone (section 1)")
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--no-steps", action="store_true", help="skip section 3 (the engine's steps)")
  ap.add_argument("--no-dense", action="store_true", help="section 3: the sparse steps only")
  args = ap.parse_args(argv)

  dargs = argparse.Namespace(topk=args.topk, set=[], layers=1, chunk=512, approx=False)
  cfgs = {dt: bench.config_for(args.context, argparse.Namespace(**vars(dargs), cache_dtype=dt), args.rows)
          for dt in ("fp8", "float32")}
  mesh = sharding.create_mesh(cfgs["fp8"])
  graphdef, params, buffers, _ = model_state.create(cfgs["fp8"], mesh)  # the parameters do not depend on the cache
  print(f"backend {jax.default_backend()} ({os.cpu_count()} cpus); {args.rows} rows x {args.context}; fp8_decode ways "
        f"{WAYS}, this backend's: {backend.choice('fp8_decode')}; median of {args.iters} calls; load average "
        f"{os.getloadavg()[0]:.1f}")
  result = dict(benchmark="decode_fp8", backend=jax.default_backend(), rows=args.rows, context=args.context,
                iters=args.iters, own=backend.choice("fp8_decode"), load_average=round(os.getloadavg()[0], 1))
  result["convert"] = convert_section(args)
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
