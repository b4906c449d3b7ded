"""The Pallas decode kernels (kernels/paged_decode.py: Mosaic; paged_decode_gpu.py: Triton) against their XLA
paths, at decode shapes.

    python benchmarks/paged_decode_kernels.py                          # 128K, rows 1 4 16, fp8 and fp32
    python benchmarks/paged_decode_kernels.py --interpret --contexts 2048 --rows 2 --iters 1   # any backend

Per (cache dtype, rows, context), the indexer's scores and the sparse MLA decode over k = 2048: each variant's
median ms, its roofline fraction (bytes over decode.py's bandwidth) and its largest difference from the XLA
reference. The kernels: Triton's on a GPU, else Mosaic's; --mla-configs sweeps Triton's MLA kernel's
(block, heads a program, warps, splits). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.decode import bandwidth  # the device's roofline bandwidth: one table
from MaxText.inference import paged_cache
from MaxText.inference.kv_cache import quantize_fp8
from MaxText.inference.paged_cache import PagedKeys
from MaxText.kernels import paged_decode as pd
from MaxText.kernels import paged_decode_gpu as pg

H_I, D_I, H, C, R, PAGE = 64, 128, 128, 512, 64, 64


def bits(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x.astype(dtype), {jnp.float8_e4m3fn: jnp.uint8, jnp.bfloat16: jnp.uint16}[dtype])


def inputs(rows: int, context: int, fp8: bool, seed: int = 0) -> dict:
  """Pools of rows * context slots (pages a random permutation), queries, a selection of k slots."""
  keys = jax.random.split(jax.random.key(seed), 8)
  p = context // PAGE
  n = rows * context
  table = jnp.asarray(np.random.default_rng(seed).permutation(rows * p).reshape(rows, p), jnp.int32)
  q = jax.random.normal(keys[0], (rows, H_I, D_I))
  w = jax.random.uniform(keys[1], (rows, H_I)) * H_I ** -0.5
  q_abs = jax.random.normal(keys[5], (rows, H, C)) * 0.05
  q_pe = jax.random.normal(keys[6], (rows, H, R)) * 0.05
  k = min(2048, context)
  pos_sel = jax.vmap(lambda kk: jax.random.choice(kk, context, (k,), replace=False))(jax.random.split(keys[7], rows))
  ids = jnp.take_along_axis(table, pos_sel // PAGE, axis=1) * PAGE + pos_sel % PAGE  # [rows,k] slot ids
  d = dict(table=table, pos=jnp.full((rows,), context - 1, jnp.int32), w=w, ids=ids, valid=jnp.ones((rows, k), bool),
           q_abs=q_abs, q_pe=q_pe)
  if fp8:  # the pools' fp8 bits drawn directly (any finite e4m3: not 0x7f/0xff), scales near 3/448: no f32 copy
    fp8_bits = lambda kk, shape: jnp.where(jax.random.bernoulli(kk, 0.5, shape), 0, 128).astype(jnp.uint8) + \
        jax.random.randint(jax.random.fold_in(kk, 1), shape, 0, 127, jnp.uint8)  # [.., n] sign | 0..126
    qq, qs = quantize_fp8(q)
    d.update(q=bits(qq, jnp.float8_e4m3fn), q_scale=qs[..., 0], idx_k=fp8_bits(keys[2], (n, D_I)),
             idx_k_scale=jax.random.uniform(keys[2], (n, 1), minval=0.5, maxval=1.5) * 3 / 448,
             c_kv=fp8_bits(keys[3], (n, C)),
             c_kv_scale=jax.random.uniform(keys[3], (n, C // 128), minval=0.5, maxval=1.5) * 3 / 448,
             k_pe=bits(jax.random.normal(keys[4], (n, R)), jnp.bfloat16))
  else:
    d.update(q=q, q_scale=None, idx_k=jax.random.normal(keys[2], (n, D_I)), idx_k_scale=None,
             c_kv=jax.random.normal(keys[3], (n, C)), c_kv_scale=None, k_pe=jax.random.normal(keys[4], (n, R)))
  return d


def scoring_fns(d: dict, interpret: bool, blocks=(32,), module=pd) -> dict:
  """kernel (at blocks[0] pages a grid step; kernel@n at the others), xla, engine."""
  w = pd.index_weights(d["w"], D_I)
  args = (d["q"], d["q_scale"], w, d["idx_k"], d["idx_k_scale"], d["table"], d["pos"])
  kernels = {}
  for i, n in enumerate(blocks):
    ppb = min(n, d["table"].shape[1])
    fn = jax.jit(functools.partial(module.paged_index_scores, page=PAGE, pages_per_block=ppb, interpret=interpret))
    kernels["kernel" if i == 0 else f"kernel@{n}"] = lambda fn=fn: fn(*args)
  if module is pg and d["idx_k_scale"] is not None:  # the hardware's fp8 conversion (and fp8 x fp8 dot), sm89+
    fn = jax.jit(functools.partial(pg.paged_index_scores, page=PAGE, pages_per_block=min(blocks[0], d["table"].shape[1]),
                                   native_fp8=True, interpret=interpret))
    kernels["kernel@native"] = lambda fn=fn: fn(*args)
  xla = jax.jit(lambda *a: pd.paged_index_scores_xla(*a, PAGE))

  @jax.jit
  def engine(q, q_scale, w_, idx_k, idx_k_scale, table, pos):  # the engine's path: PagedKeys over f32 queries
    qv = pd.as_values(q).astype(jnp.float32) * (1.0 if q_scale is None else q_scale[..., None])
    keys = PagedKeys(idx_k, idx_k_scale, table, PAGE)
    return keys.scores(qv[:, None], d["w"][:, None], pos[:, None], head_chunk=H_I)[:, 0]

  return {**kernels, "xla": lambda: xla(*args), "engine": lambda: engine(*args)}


def mla_fns(d: dict, interpret: bool, module=pd, configs=()) -> dict:
  """kernel, xla; Triton: kernel@parts1 (a bf16 query) and kernel@BLOCKxHEADSwWARPS per config."""
  args = (d["q_abs"], d["q_pe"], d["ids"], d["valid"], d["c_kv"], d["k_pe"], d["c_kv_scale"])
  k = d["ids"].shape[1]
  if module is pd:
    kernels = {"kernel": functools.partial(pd.sparse_mla_decode, block=min(256, k))}
  else:  # as the engine calls it (paged_cache.attend_selected: its block, heads a program and splits)
    engine = functools.partial(pg.sparse_mla_decode, block=paged_cache.SELECTED_BLOCK,
                               heads_per_program=paged_cache.HEADS_A_PROGRAM,
                               splits=paged_cache.mla_splits(d["ids"].shape[0], H, k))
    kernels = {"kernel": engine, "kernel@parts1": functools.partial(engine, parts=1)}
    if d["c_kv_scale"] is not None:  # the codes converted by the hardware (sm89+), with 3 parts and with 1
      kernels["kernel@native"] = functools.partial(engine, native_fp8=True)
      kernels["kernel@native1"] = functools.partial(engine, native_fp8=True, parts=1)
    for cfg in configs:  # "32x32w8s2": block 32, 32 heads a program, 8 warps, 2 splits (s: optional, 1)
      blk, heads, warps, splits = re.fullmatch(r"(\d+)x(\d+)w(\d+)(?:s(\d+))?", cfg).groups()
      kernels[f"kernel@{cfg}"] = functools.partial(pg.sparse_mla_decode, block=int(blk), heads_per_program=int(heads),
                                                   num_warps=int(warps), splits=int(splits or 1))
  fns = {name: jax.jit(lambda *a, fn=fn: fn(*a, 0.07, interpret=interpret)) for name, fn in kernels.items()}
  xla = jax.jit(lambda *a: pd.sparse_mla_decode_xla(*a, 0.07))
  return {**{name: lambda fn=fn: fn(*args) for name, fn in fns.items()}, "xla": lambda: xla(*args)}


def bytes_moved(kind: str, rows: int, context: int, fp8: bool) -> int:
  """What a call must read and write at least: (a) every key (+ its scale) and the [rows, S] scores;
  (b) k selected latents of 512 + 64 (+ 4 scales) and the [rows, 128, 512] fp32 output."""
  if kind == "scoring":
    return rows * context * ((D_I + 4 if fp8 else 4 * D_I) + 4)
  k = min(2048, context)
  return rows * k * (C + 4 * 4 + 2 * R if fp8 else 4 * (C + R)) + rows * H * C * 4


def max_rel(a: np.ndarray, ref: np.ndarray) -> float:
  finite = np.isfinite(ref)
  if not np.array_equal(finite, np.isfinite(a)):
    return float("inf")
  scale = max(float(np.max(np.abs(ref[finite]))), 1e-30)
  return float(np.max(np.abs(a[finite] - ref[finite]))) / scale


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="*", default=[131072])
  ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16])
  ap.add_argument("--dtypes", nargs="*", default=["fp8", "float32"], choices=["fp8", "float32"])
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--mla-configs", nargs="*", default=[], metavar="BLOCKxHEADSwWARPS[sSPLITS]",
                  help="triton: MLA kernel variants, e.g. 64x32w8s4 (slots a block, heads a program, warps, splits)")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (any backend; slow)")
  ap.add_argument("--pages-per-block", type=int, nargs="+", default=None,
                  help="scoring: pages a program reads; the first `kernel`, others `kernel@n` (default: the engine's)")
  args = ap.parse_args(argv)
  module = pg if jax.default_backend() == "gpu" else pd
  slots = paged_cache.GPU_SCORE_BLOCK_SLOTS if module is pg else paged_cache.SCORE_BLOCK_SLOTS
  args.pages_per_block = args.pages_per_block or [max(1, slots // PAGE)]
  gbs, source = bandwidth()
  extra = [f"kernel@{n}" for n in args.pages_per_block[1:]]
  if module is pg:  # (kernel@native: scoring and MLA; parts1, native1 and the configs: MLA)
    extra += ["kernel@native", "kernel@parts1", "kernel@native1"] + [f"kernel@{c}" for c in args.mla_configs]
  variants = ["kernel", "xla", "engine"] + extra
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); kernels {module.__name__}; roofline at "
        f"{gbs:.0f} GB/s ({source}); median of {args.iters}; interpret={args.interpret}")
  print(f"{'kernel':>8} {'dtype':>7} {'rows':>4} {'context':>7} {'MB':>8} {'bound ms':>8}  "
        + "  ".join(f"{v + ' ms':>12}" for v in variants) + f"  {'kernel/bound':>12} {'max rel diff':>12}")
  results = []
  for dtype in args.dtypes:
    for rows in args.rows:
      for context in args.contexts:
        t0 = time.perf_counter()
        d = inputs(rows, context, dtype == "fp8")
        jax.block_until_ready(d)
        print(f"  inputs: {rows} rows x {context} in {time.perf_counter() - t0:.1f} s", flush=True)
        for kind in ("scoring", "mla"):
          fns = scoring_fns(d, args.interpret, args.pages_per_block, module) if kind == "scoring" else \
              mla_fns(d, args.interpret, module, args.mla_configs)
          nbytes = bytes_moved(kind, rows, context, dtype == "fp8")
          bound = nbytes / gbs / 1e6  # ms
          row = dict(kernel=kind, dtype=dtype, rows=rows, context=context, bytes=nbytes, bound_ms=round(bound, 4))
          try:
            got, out = timing.interleaved(fns, args.iters, warmup=0)
            ms = {name: statistics.median(v) * 1e3 for name, v in got.items()}
            out = {name: np.asarray(v) for name, v in out.items()}
          except Exception as e:  # a Mosaic lowering error is a result here: print it and go on
            row["status"] = timing.failure(e)
            print(f"{kind:>8} {dtype:>7} {rows:>4} {context:>7} failed: {row['status']}", flush=True)
            results.append(row)
            continue
          pairs = [(a, b) for a, b in (("kernel", "xla"), ("kernel", "engine"), ("kernel@parts1", "xla"),
                                        ("kernel@native", "xla"), ("kernel@native1", "xla")) if a in out and b in out]
          row.update(status="ok", **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
                     max_rel_diff={f"{a}~{b}": max_rel(out[a], out[b]) for a, b in pairs})
          row["roofline_fraction"] = round(bound / ms["kernel"], 3)
          first = next(iter(row["max_rel_diff"].values()), float("nan"))
          print(f"{kind:>8} {dtype:>7} {rows:>4} {context:>7} {nbytes / 1e6:>8.1f} {bound:>8.3f}  "
                + "  ".join(f"{ms.get(v, float('nan')):>12.3f}" for v in variants)
                + f"  {row['roofline_fraction']:>12.3f} {first:>12.2e}", flush=True)
          results.append(row)
          del fns
        del d
        jax.clear_caches()
  print(json.dumps(dict(benchmark="paged_decode_kernels", backend=jax.default_backend(), module=module.__name__,
                        device=jax.devices()[0].device_kind, bandwidth_gbs=gbs, rows=results)))


if __name__ == "__main__":
  main()
