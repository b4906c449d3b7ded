"""Will it serve? Compiles (never runs) the serving engine's step for a virtual mesh and reports memory.

    python -m MaxText.serve_compile configs/base.yml model_name=deepseek3.2-671b compile_num_devices=8 \\
        ici_expert_parallelism=8 ici_data_parallelism=1 weight_quantization=fp8_block kv_cache_dtype=fp8 \\
        max_target_length=131072 serve_max_num_seqs=32 compile_hbm_gib=135 [key=value ...]

The program ServingEngine (MaxText/inference/serving.py) runs for the same keys, compiled on
`compile_num_devices` virtual CPU devices from abstract parameters and paged pools (nothing is
allocated): its largest step, serve_max_num_seqs rows of one prefill chunk each (a step with any
prefill row is [rows, chunk]; decode rows ride along), and the write of that step's cache entries
into the pools. Attention is data-parallel over sequences (rows and pool pages shard over
data x fsdp x expert), the routed experts over `expert` (all-to-all dispatch).

Pools: serve_num_pages pages of serve_page_size tokens; with compile_hbm_gib=G and no explicit
serve_num_pages the pools take what G leaves per device after the weights, temporaries and the
step's other buffers (as vLLM's gpu_memory_utilization): the step is compiled once with a small
pool to measure those, then again with the pools sized (a whole number of pages per shard).
When weights and temporaries alone exceed G: one line, exit 1; an explicit pool over G: the same.

Prints a short table, then, as the LAST line of stdout, one JSON object (bytes per device):
peak_bytes_per_device = weights + cache (+ drafts) + the step's row inputs and outputs + the larger program's
temporaries (what is resident between steps, plus what one step adds), weight_bytes_per_device
(params, buffers, the engine's head-major wkv_b copies; speculating, the MTP layer's too),
cache_bytes_per_device (speculating, with the MTP layer's pool), draft_bytes_per_device (speculating:
the drafts' distributions, [serve_max_num_seqs, k, vocab] fp32),
temp_bytes_per_device (the step's), the step's and the write's own memory analyses, cache_pages,
cache_tokens (pages x page size), tokens_per_page_shard (the longest request the pools hold),
requests_at_max_target_length (whole max_target_length sequences the pools hold: each lives in
one page shard), rows, tokens_per_row, collectives (op -> count, step and write), mesh,
page_shards, compile_seconds. Config mistakes exit 2 with one line. Keys: configs/base.yml.

Many hosts: the program is the same SPMD step whatever the process count (memory per device does not
change); `distributed_num_processes=P` (the key a multi-process run sets; only read here, nothing joins)
says how the run's devices split into P processes of compile_num_devices / P, and the plan adds
processes, devices_per_process and cross_process_axes: the mesh axes that span processes (the mesh is
laid out process by process, as jax.devices() orders a multi-process run), whose collectives cross
hosts (e.g. `expert`: the experts' all-to-all and the weights' all-gathers).
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

# The virtual-device compile turns off an XLA:CPU rewrite a GPU/TPU compile never makes (virtual_devices.CPU_FLAGS:
# the hoisted wide copy of the stacked weights). (The pools hold fp8 and bf16 fields as integer bits, which
# XLA:CPU writes in place: kv_cache.storage_dtype.)


def build_engine(config):
  """An abstract ServingEngine for config on jax.devices(): abstract params on the mesh, abstract
  pools; call under the mesh and its rules (compile_report does)."""
  from MaxText.checkpoint import model_state
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  mesh = sharding.create_mesh(config)
  graphdef, params, buffers = model_state.abstract_on_mesh(config, mesh)
  return ServingEngine(config, graphdef, params, buffers)


def resident_bytes(engine) -> dict:
  """Bytes per device the engine holds between steps: weights (params, buffers, the absorbed attention
  weights), cache (the stacks' pools) and, speculating, the MTP layer's pool (in cache: it grows per
  page) and absorbed weights (in weights), and the drafts' distributions draft_q [S,k,V] (draft)."""
  from MaxText.runtime import aot
  spec = engine.spec
  weights = aot.bytes_per_device((engine.params, engine.buffers, engine.absorbed, spec.absorbed if spec else ()))
  cache = aot.bytes_per_device((engine.pools, spec.mtp_pool if spec else ()))
  return {"weights": weights, "cache": cache, "draft": aot.bytes_per_device(spec.draft_q) if spec else 0}


def compile_report(config) -> dict:
  """The JSON object serve_compile prints for config's pools (bytes per device)."""
  import jax

  from MaxText.runtime import aot, sharding
  topology = hosts(config)  # a device count the processes do not divide: before any compile
  mesh = sharding.create_mesh(config)
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    engine = build_engine(config)
    t0 = time.perf_counter()
    step, write, rows = engine.compile_step(engine.max_seqs, engine.chunk)
    seconds = time.perf_counter() - t0
  m_step, m_write = aot.memory(step), aot.memory(write)
  held = resident_bytes(engine)
  weights, cache = held["weights"], held["cache"]
  # resident between steps: weights, pools (and the drafts' distributions); during a step also its row
  # inputs and outputs (the new entries, alive until the write) and the larger program's temporaries
  # (jit drops unused arguments such as the MTP layer's, so the step's own argument count would miss
  # weights the engine holds)
  peak = (weights + cache + held["draft"] + aot.bytes_per_device(rows) + m_step["output"]
          + max(m_step["temp"], m_write["temp"]))
  cost = step.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  collectives = aot.collective_counts(step.as_text() + "\n" + write.as_text())
  return {
      "peak_bytes_per_device": peak,
      "weight_bytes_per_device": weights,
      "cache_bytes_per_device": cache,
      "draft_bytes_per_device": held["draft"],
      "temp_bytes_per_device": m_step["temp"],
      "row_input_bytes_per_device": aot.bytes_per_device(rows),
      "step_peak_bytes_per_device": m_step["peak"],
      "step_argument_bytes_per_device": m_step["argument"],
      "step_output_bytes_per_device": m_step["output"],
      "write_peak_bytes_per_device": m_write["peak"],
      "write_temp_bytes_per_device": m_write["temp"],
      "write_alias_bytes_per_device": m_write["alias"],
      "cache_pages": engine.num_pages,
      "page_size": engine.page_size,
      "cache_tokens": engine.num_pages * engine.page_size,
      "tokens_per_page_shard": engine.num_pages // engine.shards * engine.page_size,  # the longest request that fits
      "requests_at_max_target_length": requests_that_fit(engine.num_pages, engine.shards, engine.pages_per_seq),
      "max_target_length": config.max_target_length,
      "rows": engine.max_seqs,
      "tokens_per_row": engine.chunk,
      "flops_per_device": float(cost.get("flops", 0.0)),
      "collectives": collectives,
      "mesh": {a: config.mesh_shape[a] for a in config.mesh_axes},
      "num_devices": math.prod(config.mesh_shape.values()),
      "page_shards": engine.shards,
      **topology,
      "weight_quantization": config.weight_quantization,
      "kv_cache_dtype": config.kv_cache_dtype,
      "compile_seconds": round(seconds, 2),
  }


def requests_that_fit(num_pages: int, shards: int, pages_per_seq: int) -> int:
  """Whole sequences of pages_per_seq pages the pools hold: a sequence lives in one page shard (its
  rows' device), so each shard holds (num_pages / shards) // pages_per_seq of them."""
  return num_pages // shards // pages_per_seq * shards


def hosts(config) -> dict:
  """The multi-host part of the plan: processes (distributed_num_processes; -1 = one), devices_per_process,
  and cross_process_axes: the mesh axes along which the process changes (devices numbered process by
  process, the mesh their row-major reshape: sharding.create_mesh). A device count the processes do not
  divide is a ConfigError (one line)."""
  from MaxText.config.types import ConfigError
  n = math.prod(config.mesh_shape[a] for a in config.mesh_axes)
  processes = max(config.distributed_num_processes, 1)
  if n % processes:
    raise ConfigError(f"distributed_num_processes={processes} does not divide the {n} devices of the mesh: "
                      "every process holds as many devices")
  per = n // processes
  owner = np.arange(n).reshape([config.mesh_shape[a] for a in config.mesh_axes]) // per  # [*mesh] process of a device
  crossing = [a for i, a in enumerate(config.mesh_axes) if (np.diff(owner, axis=i) != 0).any()]
  return {"processes": processes, "devices_per_process": per, "cross_process_axes": crossing}


def pages_within(probe: dict, hbm_gib: float, last: dict | None = None) -> int:
  """Pages (a multiple of the page shards) that fill what hbm_gib leaves per device, from `probe` (a
  report with a small pool). The pool's bytes grow per page; so may each program's temporaries (XLA:CPU
  copies a bf16 pool it scatters into; the 671B step's grew 0.04 GiB from the probe to 8K pages a
  shard): given `last`, a report with a larger pool that did not fit, each grows by its slope between
  the two reports, else each is taken as probe's."""
  shards = probe["page_shards"]
  per_shard = lambda r: r["cache_pages"] // shards
  page_bytes = probe["cache_bytes_per_device"] / per_shard(probe)  # one page in every shard
  fixed = (probe["weight_bytes_per_device"] + probe["draft_bytes_per_device"] + probe["row_input_bytes_per_device"]
           + probe["step_output_bytes_per_device"])  # the peak's parts that do not depend on the pool
  room = hbm_gib * 2**30 - fixed  # for the pools and the larger of the two programs' temporaries
  pages = math.inf
  for key in ("temp_bytes_per_device", "write_temp_bytes_per_device"):  # the step's, the write's
    slope = 0.0 if last is None else (last[key] - probe[key]) / (per_shard(last) - per_shard(probe))
    base = probe[key] - slope * per_shard(probe)  # this program's temporaries at 0 pages (linear in pages)
    pages = min(pages, (room - base) / (page_bytes + max(slope, 0.0)))
  return max(int(pages), 0) * shards


def _table(config, r: dict) -> str:
  from MaxText.runtime.aot import gib, report_table
  weights = f"fp8 blocks (the rest {config.weight_dtype})" if r["weight_quantization"] == "fp8_block" else config.weight_dtype
  return report_table(
      f"model {config.model_name}: serving step of {r['rows']} rows x {r['tokens_per_row']} tokens on "
      f"{r['num_devices']} devices ({{mesh}}); weights {weights}, cache {r['kv_cache_dtype']}",
      [("weights", f"{gib(r['weight_bytes_per_device'])} per device"),
       ("cache pools", f"{gib(r['cache_bytes_per_device'])}  ({r['cache_pages']:,} pages of {r['page_size']} = "
                       f"{r['cache_tokens']:,} tokens, {r['tokens_per_page_shard']:,} a shard; "
                       f"{r['requests_at_max_target_length']} requests of "
                       f"{r['max_target_length']:,})"),
       ("temporaries", f"{gib(r['temp_bytes_per_device'])}  (the write of new entries: "
                       f"{r['write_temp_bytes_per_device'] / 2**30:.2f} GiB)"),
       *([("hosts", f"{r['processes']} processes x {r['devices_per_process']} devices; across hosts: "
                    f"{', '.join(r['cross_process_axes']) or 'none'}")] if r["processes"] > 1 else [])],
      r)


def _report_or_exit(config) -> dict:
  """compile_report; a config mistake it meets (e.g. rows not a multiple of the page shards) exits 2 in one line."""
  from MaxText.runtime import cli
  out = {}
  cli.run(lambda: out.update(compile_report(config)))
  return out


def weights_hint(config) -> str:
  """What would shard the weights, when the data axis holds copies of them ("" when it does not):
  the default mesh puts every device on `data`, where each holds all the weights."""
  copies = config.mesh_shape["data"]
  if copies == 1:
    return ""
  return (f"; each of the data={copies} devices holds a copy of the weights: shard them over devices with "
          f"ici_expert_parallelism (the routed experts) and ici_fsdp_parallelism (the other weights), e.g. "
          f"ici_expert_parallelism={copies} ici_data_parallelism=1")


def _fail(line: str) -> None:
  print(f"error: {line}", file=sys.stderr, flush=True)
  sys.exit(1)


def main(argv) -> None:
  from MaxText.config import pyconfig
  from MaxText.runtime import virtual_devices
  if any(a in ("-h", "--help") for a in argv[1:]):
    pyconfig.initialize_or_exit(["python -m MaxText.serve_compile", "--help"], __doc__)  # prints usage, exits 0
  virtual_devices.setup_or_exit(argv, topology=False)
  config = pyconfig.initialize_or_exit(argv, __doc__)
  from MaxText.inference import paged_pools
  from MaxText.runtime import sharding

  hbm = config.compile_hbm_gib
  if hbm and not config.serve_num_pages:  # size the pools by what hbm leaves: probe with one request per shard
    shards = paged_pools.page_shards(config, sharding.create_mesh(config))
    pages_per_seq = -(-config.max_target_length // config.serve_page_size)
    probe = _report_or_exit(pyconfig.initialize_or_exit(argv, __doc__, serve_num_pages=shards * pages_per_seq))
    pages = pages_within(probe, hbm)
    if pages == 0:
      _fail(f"weights ({probe['weight_bytes_per_device'] / 2**30:.2f} GiB) and temporaries "
            f"({probe['temp_bytes_per_device'] / 2**30:.2f} GiB) need "
            f"{(probe['peak_bytes_per_device'] - probe['cache_bytes_per_device']) / 2**30:.2f} GiB per device: "
            f"no room for the cache pools in compile_hbm_gib={hbm:g}{weights_hint(config)}")
    config = pyconfig.initialize_or_exit(argv, __doc__, serve_num_pages=pages)
    r = _report_or_exit(config)
    if r["peak_bytes_per_device"] > hbm * 2**30:  # the write's temporaries grew with the pool: size again
      pages = pages_within(probe, hbm, last=r)
      if pages:
        config = pyconfig.initialize_or_exit(argv, __doc__, serve_num_pages=pages)
        r = _report_or_exit(config)
  else:
    r = _report_or_exit(config)
  print(_table(config, r), flush=True)
  print(json.dumps(r), flush=True)
  if hbm and r["peak_bytes_per_device"] > hbm * 2**30:
    _fail(f"needs {r['peak_bytes_per_device'] / 2**30:.2f} GiB per device, the limit is {hbm:g} (compile_hbm_gib)"
          f"{weights_hint(config)}")


if __name__ == "__main__":
  main(sys.argv)
