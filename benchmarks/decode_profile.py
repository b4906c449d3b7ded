"""Where a sparse decode step's time goes: the engine's step (benchmarks/decode.py's model and pools) under
jax.profiler, its device ops summed by the source line that made them, and the sparse path's pieces timed alone.

    python benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --out /tmp/prof
    python benchmarks/decode_profile.py --rows 2 --context 4096 --topk 512 --iters 2     # CPU smoke run
    PYTHONPATH=/tmp/libtpu:. python benchmarks/decode_profile.py --compile-for v5e:1x1 --set serve_page_size=256

Prints the step's median and launches, the trace's tables (per part, source line, op: profile_ops.summarize), the
pieces (indexer scores, selection, gather, attention, the sparse MLA kernel), then one JSON line. --compile-for
runs nothing: XLA's estimates for a TPU topology (libtpu installed aside: `pip install --target /tmp/libtpu
libtpu==0.0.42.1`). Asserts nothing about time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import decode as bench  # the model, the pools and the step
from benchmarks import profile_ops, timing
from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.inference import paged_cache, step_feed  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.kernels import backend, paged_decode, paged_decode_gpu  # noqa: E402
from MaxText.kernels.sparse_attention import gather_attend  # noqa: E402
from MaxText.kernels.topk_indices import topk_indices  # noqa: E402
from MaxText.runtime import sharding  # noqa: E402

TRACE_STEPS = 3  # steps the profile traces
# (part, file suffix or suffixes, function names or None = any): the first match names a source line's part
PARTS = (
    ("scoring", "kernels/paged_decode.py", ("paged_index_scores", "_score_kernel", "_each_copy", "_pipelined",
                                            "e4m3_to_f32", "_decode", "index_weights")),
    ("scoring", "kernels/paged_decode_gpu.py", ("paged_index_scores", "_score_kernel")),
    ("scoring", "inference/paged_cache.py", ("scores", "_kernel_scores", "select_over_pages", "run")),
    ("scoring", "kernels/index_scores.py", None),
    ("weights: absorbed wkv_b", "kernels/sparse_attention.py", ("absorb_q", "unabsorb_out")),
    ("scoring (splice, new keys)", "kernels/cached_attention.py", ("index_scores_spliced", "splice", "row")),
    ("attention", "kernels/topk_indices.py", ("gather_rows",)),  # gather_attend's row gather of the selected
    ("selection", ("kernels/selection.py", "kernels/selection_keys.py", "kernels/topk_indices.py"), None),
    ("gather", "inference/paged_cache.py", ("gather_selected", "read")),
    ("gather", "inference/paged_pools.py", ("_rows",)),
    ("gather", "inference/kv_cache.py", None),
    ("gather", "kernels/cached_attention.py", ("merge_selected",)),
    ("attention", "kernels/sparse_attention.py", None),
    ("attention", "kernels/paged_decode.py", ("sparse_mla_decode", "_mla_kernel", "_dequant")),
    ("attention", "kernels/paged_decode_gpu.py", ("sparse_mla_decode", "_mla_kernel")),
    ("write", "inference/paged_pools.py", ("write", "put_all", "slots")),
    ("indexer q, k, w", "layers/indexer.py", None),
    ("MLA projections", "layers/attention_mla.py", None),
    ("weights: linears", "layers/linears.py", None),
    ("weights: linears", "kernels/fp8_blocks.py", ("matmul",)),
    ("sampling", ("inference/sampling.py", "inference/penalties.py", "inference/serving.py"), None),
)


def pieces(engine: ServingEngine, feed: dict, args) -> list[dict]:
  """The sparse path's pieces on layer 0's pool, each its own program."""
  cfg, pool = engine.config, next(iter(engine.pools.values()))
  pool = pool[0] if isinstance(pool, list) else jax.tree.map(lambda a: a[0], pool)
  table = jnp.asarray(feed["table"])  # [B,P]
  b = table.shape[0]
  pos = jnp.asarray(feed["positions"][:, 0])  # [B]
  h, d, k = cfg.indexer_n_heads, cfg.indexer_head_dim, min(cfg.indexer_topk, engine.pages_per_seq * engine.page_size)
  key = jax.random.key(0)
  q = jax.random.normal(key, (b, 1, h, d), jnp.float32)
  w = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, h), jnp.float32) * h ** -0.5
  keys = paged_cache.PagedKeys(pool.idx_k, pool.idx_k_scale, table, engine.page_size)

  def scores_with(route, q=q, w=w):  # traced (its first call) inside the forced block: the route is read when traced
    fn = jax.jit(lambda q, w, pos: keys.scores(q, w, pos[:, None], head_chunk=16))
    with backend.forced(paged_scoring=route):
      jax.block_until_ready(fn(q, w, pos))
    return fn

  rows = []
  kernel = backend.choice("paged_scoring")  # the kernels in force, else this backend's: Triton's on a GPU, Mosaic's
  if kernel == "xla":
    kernel = "triton" if jax.default_backend() == "gpu" else "pallas"
  fns = {f"scoring ({route})": (scores_with(route), (q, w, pos)) for route in (kernel, "xla")}
  if pool.idx_k_scale is not None:  # the engine's queries with an fp8 cache (indexer_fp8_queries): one MXU pass
    q8, w8 = paged_decode.fp8_scored_queries(q, w)
    fns[f"scoring ({kernel}, fp8 queries)"] = (scores_with(kernel, q8, w8), (q8, w8, pos))
  scores = fns[f"scoring ({backend.choice('paged_scoring')})"][0](q, w, pos)  # [B,1,S]
  select = jax.jit(lambda s: topk_indices(s, k))
  idx, valid = select(scores)  # [B,1,k]
  fns["selection (topk_indices)"] = (select, (scores,))
  fns["selection (lax.top_k)"] = (jax.jit(lambda s: jax.lax.top_k(s, k)), (scores,))
  fns["selection (lax.approx_max_k)"] = (jax.jit(lambda s: jax.lax.approx_max_k(s, k, recall_target=0.95)), (scores,))
  gather = jax.jit(lambda table, idx: paged_cache.gather_selected(pool, table, idx, engine.page_size))
  c_sel, pe_sel = gather(table, idx[:, 0])  # [B,k,c], [B,k,r]
  fns["gather (gather_selected)"] = (gather, (table, idx[:, 0]))
  nh, c, r = cfg.num_query_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  q_abs = jax.random.normal(jax.random.fold_in(key, 2), (b, 1, nh, c), jnp.float32)
  q_pe = jax.random.normal(jax.random.fold_in(key, 3), (b, 1, nh, r), jnp.float32)
  attend = jax.jit(lambda q_abs, q_pe, c_sel, pe_sel, valid: gather_attend(q_abs, q_pe, c_sel, pe_sel, None, valid,
                                                                           cfg.softmax_scale)[0])  # rows in order
  fns["attention (gather_attend)"] = (attend, (q_abs, q_pe, c_sel, pe_sel, valid))
  slot_ids = jnp.take_along_axis(table, idx[:, 0] // engine.page_size, axis=1) * engine.page_size \
      + idx[:, 0] % engine.page_size  # [B,k]
  kernel_k = -(-k // 256) * 256
  ids = jnp.pad(slot_ids, ((0, 0), (0, kernel_k - k)))
  ok = jnp.pad(valid[:, 0], ((0, 0), (0, kernel_k - k)))
  mla_kernel = (paged_decode_gpu if kernel == "triton" else paged_decode).sparse_mla_decode
  mla = jax.jit(lambda ids, ok: mla_kernel(q_abs[:, 0], q_pe[:, 0], ids, ok, pool.c_kv, pool.k_pe, pool.c_kv_scale,
                                           cfg.softmax_scale))
  fns[f"gather + attention (sparse_mla_decode, {kernel})"] = (mla, (ids, ok))
  for name, (fn, fargs) in fns.items():
    try:
      ms = timing.median_ms(lambda fn=fn, fargs=fargs: fn(*fargs), args.iters)
    except Exception as e:  # a piece that does not lower here (e.g. Mosaic) is reported, not fatal
      print(f"  {name}: failed: {timing.failure(e)}")
      ms = float("nan")
    rows.append(dict(piece=name, ms=round(ms, 3)))
    print(f"{name:>40} {ms:>10.3f}", flush=True)
  return rows


def launches(engine: ServingEngine, feed: dict, args) -> list[dict]:
  """Where the step's wall time goes outside its device ops: the feed's host-to-device copy alone,
  the step program alone on a feed already on the device, the step and write programs on it, and a trivial
  jitted call (this host's per-call floor); medians of --iters calls, each waited for."""
  buf = step_feed.to_device(feed)
  t = feed["t"]
  step, _ = engine.compile_programs(t, buf)

  step_alone = lambda: step(engine.params, engine.buffers, engine.pools, engine.absorbed, buf)[1]  # noqa: E731

  def step_and_write():
    engine.pools, sampled, _ = engine.run(t, {"buf": buf})
    return engine.pools, sampled

  one = jnp.zeros((), jnp.int32)
  trivial = jax.jit(lambda x: x + 1)
  fns = {"feed to the device": lambda: step_feed.to_device(feed), "step program (feed on the device)": step_alone,
         "step + write programs (feed on the device)": step_and_write,
         "a trivial jitted call": lambda: trivial(one)}
  rows = []
  print(f"\n{'launches (wall, median)':>44} {'ms':>10}")
  for name, fn in fns.items():
    ms = timing.median_ms(fn, args.iters)
    rows.append(dict(call=name, ms=round(ms, 3)))
    print(f"{name:>44} {ms:>10.3f}", flush=True)
  return rows


def profile(engine: ServingEngine, feed: dict, run, args) -> list[dict]:
  """The step under jax.profiler; device time per part and per source line."""
  buf = step_feed.to_device(feed)
  step, write = engine.compile_programs(feed["t"], buf)
  trace = os.path.join(args.out, "trace")
  jax.block_until_ready(run())
  with jax.profiler.trace(trace):
    for _ in range(TRACE_STEPS):
      jax.block_until_ready(run())
  return profile_ops.summarize(trace, [step.as_text(), write.as_text()], PARTS, TRACE_STEPS, args.top)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--context", type=int, default=131072)
  bench.model_args(ap, "fp8", 7)
  ap.set_defaults(chunk=512)  # decode.py's --chunk: the model's prefill chunk
  ap.add_argument("--top", type=int, default=25, help="source lines listed")
  ap.add_argument("--out", default="/tmp/decode_profile")
  ap.add_argument("--no-trace", action="store_true")
  ap.add_argument("--no-pieces", action="store_true")
  ap.add_argument("--compile-for", metavar="TOPOLOGY", help="compile only, for a TPU topology (e.g. v5e:1x1)")
  args, force = timing.parse(ap, argv, "model config overrides over decode.py's WIDE")
  if args.compile_for:
    compile_for(args, force)
    return
  with backend.forced(**force):
    run_all(args)


def compile_for(args, force: dict) -> None:
  """The step and write compiled for --compile-for's TPU topology, nothing run."""
  devices = profile_ops.topology_devices(args.compile_for)
  if devices is None:
    sys.exit(2)
  t0 = time.perf_counter()
  cfg = bench.config_for(args.context, args, args.rows)
  mesh = sharding.create_mesh(cfg, devices)
  with backend.forced("tpu", **force), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers = model_state.abstract_on_mesh(cfg, mesh)
    engine = ServingEngine(cfg, graphdef, params, buffers, attention="sparse")
    step, write, _ = engine.compile_step(args.rows, 1)
  texts = [step.as_text(), write.as_text()]
  print(f"{args.rows} rows x {args.context}, {args.layers} layer(s), {args.cache_dtype} cache, top-k {args.topk}; "
        f"{' '.join(args.set)}; forced {force}; compiled for {args.compile_for} in {time.perf_counter() - t0:.0f} s "
        f"(nothing run)")
  report = profile_ops.compiled_report(texts, 1.5, PARTS, args.top, 4.0)  # XLA's cycles at 1.5 GHz; writes >= 4 MB
  print(json.dumps(dict(benchmark="decode_profile", compile_for=args.compile_for, rows=args.rows, context=args.context,
                        layers=args.layers, cache_dtype=args.cache_dtype, overrides=args.set, forced=force, **report)))


def run_all(args) -> None:
  os.makedirs(args.out, exist_ok=True)
  cfg = bench.config_for(args.context, args, args.rows)  # decode.py's model
  mesh = sharding.create_mesh(cfg)
  graphdef, params, buffers, _ = model_state.create(cfg, mesh)
  engine = ServingEngine(cfg, graphdef, params, buffers, attention="sparse")
  bench.fill_pools(engine, seed=args.context)
  feed = bench.step_feed_at_end(engine, args.rows, 1)
  if args.short_context:  # rows after the first end early: the scoring reads no block past a row's position
    feed["positions"][1:], feed["draw_at"][1:] = min(args.short_context, args.context) - 1, args.short_context
  run = bench.paged_step(engine, feed)
  step_ms = timing.median_ms(run, args.iters)
  need = bench.step_bytes(cfg, params, args.rows, args.context)
  if args.short_context and args.rows > 1:  # the first row's bytes at --context, the others' at --short-context
    long, short = (bench.step_bytes(cfg, params, n, c) for n, c in ((1, args.context), (args.rows - 1, args.short_context)))
    need = {m: long[m] + short[m] - need["weights"] for m in need}
  gbs, source = bench.bandwidth()
  bound = need["sparse"] / gbs / 1e6
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); {args.rows} rows x {args.context}"
        f"{f' (rows after the first at {args.short_context})' if args.short_context else ''}, {args.layers} layer(s), "
        f"{args.cache_dtype} cache, top-k {cfg.indexer_topk}; {' '.join(args.set)}; kernel choices "
        f"{dataclasses.asdict(backend.choices())}")
  print(f"sparse step (step + write programs): {step_ms:.3f} ms, median of {args.iters}; bound "
        f"{need['sparse'] / 1e6:.0f} MB at {gbs:.0f} GB/s ({source}) = {bound:.3f} ms: {bound / step_ms:.1%} of the roofline")
  result = dict(benchmark="decode_profile", backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                rows=args.rows, context=args.context, layers=args.layers, short_context=args.short_context,
                cache_dtype=args.cache_dtype, topk=cfg.indexer_topk,
                overrides=args.set, choices=dataclasses.asdict(backend.choices()),
                step_ms=round(step_ms, 3), bound_ms=round(bound, 4), roofline=round(bound / step_ms, 4))
  result["launches"] = launches(engine, feed, args)
  if not args.no_trace:
    result["parts"] = profile(engine, feed, run, args)
  if not args.no_pieces:
    print(f"\n{'piece (alone, layer 0 pool)':>40} {'ms':>10}")
    result["pieces"] = pieces(engine, feed, args)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
