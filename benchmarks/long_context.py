"""Long-context train step on one device: the sparse stage's gather path beside the dense mask path, per length.

    python benchmarks/long_context.py                                    # 8K, 16K, 32K, 64K; gather and mask
    python benchmarks/long_context.py --lengths 32768 --paths gather,gather_fixed,mask --budget 540
    python benchmarks/long_context.py --compile-only  # memory per length and path (DEVICE_CHECK_MEMORY_GIB)
    python benchmarks/long_context.py --quick                            # a CPU smoke run (tiny shapes, seconds)
    python benchmarks/long_context.py --lengths 32768 --trace /tmp/long  # and the first path's profile per length
    PYTHONPATH=/tmp/libtpu:. python benchmarks/long_context.py --lengths 32768 --paths gather --compile-for v5e:1x1

The model is configs/models/deepseek3.2-v5e.yml (the official MLA and indexer shapes), thinned per rung, at
max_target_length = each length, one sequence a step; the step is tools/device/device_check.py's train_step (its
memory checked before anything is allocated, then --steps steps timed after a warm-up, median). Each path (PATHS) is
a set of config overrides; per length the rungs of --set (default LADDER) are tried largest first, the first at which
the first path fits is that length's rung, every other path runs at that rung (equal shapes side by side). --budget:
a run that would start with under MIN_START_S left is skipped. --trace DIR: the first path's profile per length
(profile_ops, train_mfu.py's PARTS). --compile-for TOPOLOGY runs nothing: each (length, path) at the first rung
compiled for a TPU (libtpu aside, as decode_profile.py): temp memory, XLA's estimate per part / line / op, the
whole arrays written (profile_ops.compiled_report). The design and the figures: docs/benchmarks.md.
Prints a line per run as it ends, a table, and one JSON line. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools", "device")]
import device_check  # noqa: E402  (tools/device/device_check.py: the train step, compiled, fitted, timed)

from benchmarks import profile_ops, timing, train_mfu  # noqa: E402  (train_mfu's PARTS: the model's parts by file)
from MaxText.kernels import backend  # noqa: E402

GATHER = dict(indexer_training_stage="sparse", sparse_attention_impl="gather", sparse_attention_block_remat=True)
PATHS = {
    "gather": GATHER,  # the sparse stage (attention over the indexer's top-k, the indexer trained by its KL)
    "gather_fixed": {**GATHER, "indexer_training_stage": "none"},  # a fixed selector: no KL, no indexer gradient
    "gather_saved": {**GATHER, "sparse_attention_block_remat": False},  # a block's queries, outputs kept
    "gather_qb128": {**GATHER, "sparse_attention_query_block": 128},  # 128 / 512 queries a block (the file's 256)
    "gather_qb512": {**GATHER, "sparse_attention_query_block": 512},
    "gather_save_sel": {**GATHER, "remat_policy": "save_attention_selection"},  # selection kept for the backward
    "mask": dict(use_indexer=False),  # the dense step, MLA's mask path (splash on a TPU)
    "mask_topk": dict(indexer_training_stage="sparse", sparse_attention_impl="mask"),  # a [b,t,s] top-k mask
}
LENGTHS = (8192, 16384, 32768, 65536)
# Rungs tried per length, largest first (KEY=VALUE lists), from XLA:CPU's memory analysis of this step (an upper
# bound; docs/benchmarks.md): the v5e file's 2 layers and 32K vocabulary (2 x 32768 x 7168 embedding and head, [t, V]
# f32 logits) leave too little for 8K tokens, so every rung has one dense layer (the MoE layer dropped), a vocabulary
# of 8192 and remat full; then half and a quarter of the 128 heads (the gather path keeps each query's [h, nope+r]
# for its backward pass, splash its [h, 192] q and k: both grow with the heads).
THIN = ("remat_policy=full", "num_decoder_layers=1", "first_num_dense_layers=1", "vocab_size=8192")
LADDER = (THIN, THIN + ("num_query_heads=64",), THIN + ("num_query_heads=32",))
# --quick: the v5e file's layout at CPU size (2 layers, 1 dense + 1 MoE), lengths past its top-k of 64
QUICK = dict(lengths=(256, 512), steps=2, rung=("emb_dim=128", "mlp_dim=256", "moe_mlp_dim=64", "num_query_heads=4",
                                                "q_lora_rank=32", "kv_lora_rank=32", "qk_nope_head_dim=32",
                                                "qk_rope_head_dim=16", "v_head_dim=32", "indexer_n_heads=4",
                                                "indexer_head_dim=32", "indexer_topk=64", "vocab_size=512",
                                                "sparse_attention_query_block=128", "remat_policy=full",
                                                "dtype=float32", "weight_dtype=float32"))
MIN_START_S = 60  # a run that would start with less budget left is skipped


def overrides(model: str, length: int, rung, path: str, base=()) -> dict:
  """The train step's config overrides for one (length, rung, path); `base` (KEY=VALUE) under the rung, the path's
  keys over the rung's."""
  return dict(model_name=model, max_target_length=length, max_prefill_length=length, global_batch_size=1,
              **{**timing.overrides(base), **timing.overrides(rung), **PATHS[path]})


def measure(model, lengths, paths, ladder, steps, compile_only, force, deadline, base=(), trace=None, top=15):
  """Each length's rung and each path's train_step result there -> rows (one dict per (length, path)); trace: the
  first path's profile per length under trace/<length>, its parts in the row."""
  rows = []

  def run(length, rung, path):
    where = os.path.join(trace, str(length)) if trace and path == paths[0] and not compile_only else None
    if time.perf_counter() > deadline - MIN_START_S:
      r = dict(skipped=f"out of budget (under {MIN_START_S} s left)")
    else:
      try:
        with backend.forced(**force):
          r = device_check.train_step(overrides(model, length, rung, path, base), steps, where, compile_only)
        if (hlo := r.pop("hlo", None)) is not None:
          r["parts"] = profile_ops.summarize(where, [hlo], train_mfu.PARTS, 2, top)
      except Exception as e:  # a path that fails to compile or run is a row; the others still run
        r = dict(failed=timing.failure(e))
    r = dict(length=length, path=path, rung=" ".join(rung), **r)
    print("run " + json.dumps(r), flush=True)
    return r

  for length in lengths:
    for rung in ladder:  # every rung tried stays a row: what did not fit, with its peak
      first = run(length, rung, paths[0])
      rows.append(first)
      if first.get("fits") or "skipped" in first:
        break
    if first.get("fits"):
      rows.extend(run(length, rung, path) for path in paths[1:])
    else:
      rows.extend(dict(length=length, path=path, rung=None, skipped=f"no rung fits {paths[0]}") for path in paths[1:])
  return rows


def compile_for(model, lengths, paths, rung, topology, force, base=(), top=15, min_mb=100.0, clock_ghz=1.5) -> list:
  """Each (length, path)'s train step compiled for a TPU topology from abstract inputs, nothing run (module doc):
  rows of temp / argument GiB and compiled_report's estimate, parts and materialized arrays."""
  import jax

  from MaxText import train
  from MaxText.config import pyconfig
  from MaxText.runtime import sharding

  devices = profile_ops.topology_devices(topology)
  if devices is None:
    return []
  rows = []
  for length in lengths:
    for path in paths:
      t0 = time.perf_counter()
      try:
        cfg = pyconfig.initialize(["long_context", "base.yml"], num_devices=1, ici_data_parallelism=1,
                                  scan_layers=False, enable_checkpointing=False, enable_tensorboard=False,
                                  **overrides(model, length, rung, path, base))
        mesh = sharding.create_mesh(cfg, devices[:1])
        with backend.forced("tpu", **force), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
          abs_state, abs_batch, step_fn = train.abstract_train_step(cfg, mesh)
          compiled = step_fn.lower(abs_state, abs_batch).compile()
        mem = compiled.memory_analysis()
        print(f"\n== {length} tokens, path {path}, {' '.join(rung)}; forced {force}; compiled for {topology} in "
              f"{time.perf_counter() - t0:.0f} s: temp {mem.temp_size_in_bytes / 2**30:.2f} GiB", flush=True)
        report = profile_ops.compiled_report([compiled.as_text(), ""], clock_ghz, train_mfu.PARTS, top, min_mb)
        r = dict(temp_gib=round(mem.temp_size_in_bytes / 2**30, 3),
                 argument_gib=round(mem.argument_size_in_bytes / 2**30, 3), **report)
      except Exception as e:  # a path that fails to compile is a row; the others still compile
        r = dict(failed=timing.failure(e))
        print(f"\n== {length} tokens, path {path}: {r['failed']}", flush=True)
      rows.append(dict(length=length, path=path, rung=" ".join(rung), **r))
  return rows


def fmt(r: dict) -> str:
  """One table row's figures."""
  if "skipped" in r or "failed" in r:
    return f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['failed']}"
  if not r.get("fits"):
    return f"does not fit: {r.get('peak_gib')} GiB > {r.get('limit_gib')} GiB"
  mem = f"peak {r['peak_gib']} GiB, compile {r['compile_s']} s"
  if "step_ms" not in r:
    return mem
  return f"{r['step_ms']:.1f} ms, model MFU {r['model_mfu']:.1%}, loss {r['loss']}; {mem}"


def ratios(rows) -> dict:
  """Per length, each fitted path's step time over the gather path's (> 1: gather is that much faster)."""
  out = {}
  for r in rows:
    g = next((x for x in rows if x["length"] == r["length"] and x["path"] == "gather" and "step_ms" in x), None)
    if g and "step_ms" in r and r["path"] != "gather" and r.get("rung") == g["rung"]:
      out[f"{r['length']}:{r['path']}/gather"] = round(r["step_ms"] / g["step_ms"], 3)
  return out


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="deepseek3.2-v5e", help="model_name (configs/models/<name>.yml)")
  ap.add_argument("--lengths", default=None, help=f"comma-separated tokens a sequence (default {LENGTHS})")
  ap.add_argument("--paths", default="gather,mask", help="comma-separated PATHS; the first picks each length's rung")
  ap.add_argument("--steps", type=int, default=None, help="timed steps (median) after a warm-up (default 5)")
  ap.add_argument("--budget", type=float, default=None, help="seconds for everything (default: no limit)")
  ap.add_argument("--trace", metavar="DIR", help="the first path's profile per length (DIR/<length>)")
  ap.add_argument("--compile-only", action="store_true", help="compiled memory alone")
  ap.add_argument("--compile-for", metavar="TOPOLOGY", help="compile only, for a TPU topology (e.g. v5e:1x1)")
  ap.add_argument("--quick", action="store_true", help="a CPU smoke run: QUICK's shapes, lengths, steps")
  args, force = timing.parse(ap, argv, "overrides of one rung; repeat --set for further rungs (largest first; default "
                             "LADDER)", rungs=True)
  lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else QUICK["lengths"] if args.quick else LENGTHS
  paths = args.paths.split(",")
  if bad := [p for p in paths if p not in PATHS]:
    ap.error(f"--paths: no path {bad[0]!r}; the paths are {', '.join(PATHS)}")
  ladder = args.set or ([[]] if args.quick else list(LADDER))
  if args.compile_for:
    rows = compile_for(args.model, lengths, paths, ladder[0], args.compile_for, force,
                       QUICK["rung"] if args.quick else ())
    for r in rows:
      print(f"{r['length']:>7} {r['path']:<13} " + (f"failed: {r['failed']}" if "failed" in r else
            f"temp {r['temp_gib']} GiB, XLA's estimate {r['estimated_ms']} ms (each op once)"))
    print(json.dumps(dict(benchmark="long_context", model=args.model, compile_for=args.compile_for,
                          forced=args.force, rows=[{k: v for k, v in r.items() if k != "materialized"} for r in rows])))
    return
  steps = args.steps or (QUICK["steps"] if args.quick else 5)
  deadline = time.perf_counter() + (args.budget or float("inf"))
  rows = measure(args.model, lengths, paths, ladder, steps, args.compile_only, force, deadline,
                 QUICK["rung"] if args.quick else (), args.trace)

  mask_way = backend.choice("mask_attention") if "mask_attention" not in force else force["mask_attention"]
  print(f"long-context train step, {args.model}{' at --quick sizes' if args.quick else ''}, 1 sequence a step, "
        f"median of {steps} steps (mask path's dense attention: {mask_way})")
  print(f"{'tokens':>7} {'path':<13} {'rung':<60} figures")
  for r in rows:
    print(f"{r['length']:>7} {r['path']:<13} {(r.get('rung') or '-')[-60:]:<60} {fmt(r)}")
  got = ratios(rows)
  for name, v in got.items():
    print(f"{name}: {v}x the gather path's step time")
  print(json.dumps(dict(benchmark="long_context", model=args.model, quick=args.quick, steps=steps,
                        compile_only=args.compile_only,
                        forced=args.force, mask_attention=mask_way, ratios=got, rows=rows)))


if __name__ == "__main__":
  main()
