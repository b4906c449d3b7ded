"""Will it fit? Compiles (never runs) the train step of train.py for a virtual mesh and reports memory.

    python -m MaxText.train_compile configs/base.yml model_name=deepseek3.2-671b compile_num_devices=256 \\
        ici_fsdp_parallelism=32 ici_expert_parallelism=8 [key=value ...]

The same step function, shardings, optimizer and precision as `python MaxText/train.py` with the same
keys, compiled on `compile_num_devices` virtual CPU devices (this sets
--xla_force_host_platform_device_count before jax is imported). Parameters, optimizer state and
batch are abstract (jax.ShapeDtypeStruct): nothing is allocated, so a 671B step compiles on a laptop.
Prints a short table, then, as the LAST line of stdout, one JSON object (bytes are per device):
peak_bytes_per_device, parameter_bytes_per_device, optimizer_bytes_per_device, temp_bytes_per_device,
trainable_parameters; under LoRA (lora_rank > 0) also adapter_bytes_per_device and base_bytes_per_device (the
frozen base: its params, fp8 + scales under weight_quantization=fp8_block, and routing biases),
argument/output/alias bytes, flops_per_step (XLA cost analysis of the per-device program x devices: a loop's
body counted once), collectives (op -> count in the program text), collective_traffic (op -> count and bytes one
device sends in a step, loops by their trip counts), compile_seconds, mesh, tokens_per_step, and step_estimate
(seconds a step takes on the compiled-for chip, from the model's FLOPs and collective_traffic; null where the
chip's peak or interconnect is not in runtime/metrics.py's tables, e.g. virtual CPU devices).
With compile_hbm_gib=N > 0 it exits 1 with one line when the peak exceeds N GiB per device. compile_topology=v5p:8x8x4
(a TPU topology; libtpu importable, e.g. pip install --target DIR libtpu==0.0.42.1 with DIR on PYTHONPATH) compiles
for that topology's chips with the TPU compiler instead of virtual CPU devices: its memory analysis is the chip's.
Config mistakes exit 2 with one line, as everywhere. Every key is documented in configs/base.yml.
"""

from __future__ import annotations

import json
import math
import sys
import time


def compile_train_step(config, devices=None):
  """The train step of train.py for `config` on `devices` (default jax.devices(); a TPU topology's from
  aot.topology_devices), compiled from abstract inputs. Returns (compiled, abstract state, abstract batch, seconds)."""
  import jax

  from MaxText import train
  from MaxText.runtime import sharding
  mesh = sharding.create_mesh(config, devices)
  with traced_for(devices), jax.set_mesh(mesh), sharding.logical_rules(config, mesh):  # as train.py's mesh
    state, batch, step_fn = train.abstract_train_step(config, mesh)
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - t0


def compile_or_exit(config, devices=None):
  """compile_train_step, or, where the compiler finds the step larger than the device's memory (the TPU compiler
  refuses it: RESOURCE_EXHAUSTED), its one line on stderr and exit 1, as a peak over compile_hbm_gib exits."""
  import jax
  try:
    return compile_train_step(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    kind = devices[0].device_kind if devices else jax.devices()[0].device_kind
    print(f"error: the train step does not fit a {kind}'s memory: {str(e).splitlines()[0]} (the levers: "
          "docs/training.md)", file=sys.stderr, flush=True)
    sys.exit(1)


def traced_for(devices):
  """The kernels' choices (kernels/backend.py) of the devices compiled for: a TPU topology's on this host takes
  the TPU row (its selection, attention and MoE paths, Mosaic's lowering), not this process's CPU row."""
  from MaxText.kernels import backend
  return backend.forced(devices[0].platform if devices else None)


def report(config, compiled, state, batch, seconds: float) -> dict:
  """The JSON object train_compile prints (bytes per device)."""
  import jax

  from MaxText.checkpoint import model_state, orbax_state
  from MaxText.runtime import aot
  mem = aot.memory(compiled)
  frozen = state.get(orbax_state.FROZEN, {})
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  n = math.prod(config.mesh_shape.values())
  hlo = compiled.as_text()
  r = {
      "peak_bytes_per_device": mem["peak"],
      "parameter_bytes_per_device": aot.bytes_per_device((state["params"], state["buffers"], frozen)),
      **({"adapter_bytes_per_device": aot.bytes_per_device(state["params"]),
          "base_bytes_per_device": aot.bytes_per_device(frozen)} if config.lora_rank else {}),
      "trainable_parameters": model_state.count_params(state["params"]),
      "total_parameters": model_state.count_params((state["params"], frozen)),
      "optimizer_bytes_per_device": aot.bytes_per_device(state["opt_state"]),
      "batch_bytes_per_device": aot.bytes_per_device(batch),
      "temp_bytes_per_device": mem["temp"],
      "argument_bytes_per_device": mem["argument"],
      "output_bytes_per_device": mem["output"],
      "alias_bytes_per_device": mem["alias"],
      "flops_per_device": float(cost.get("flops", 0.0)),
      "flops_per_step": float(cost.get("flops", 0.0)) * n,
      "collectives": aot.collective_counts(hlo),
      "collective_traffic": aot.collective_traffic(hlo, n),
      "compile_seconds": round(seconds, 2),
      "mesh": {a: config.mesh_shape[a] for a in config.mesh_axes},
      "num_devices": n,
      "tokens_per_step": config.global_batch_size * config.max_target_length,
  }
  kind = next(iter(jax.tree.leaves(state)[0].sharding.device_set)).device_kind
  r["step_estimate"] = step_estimate(config, r, kind)
  return r


def step_estimate(config, r: dict, device_kind: str) -> dict | None:
  """Seconds a step takes on `device_kind`, estimated from the compiled program (None where metrics' tables
  lack the kind's peak FLOP/s or ring bandwidth). compute: the model's FLOPs a device (metrics.
  model_flops_per_token; the compiled count sees a layer scan's body once) x 4/3 where layers are
  rematerialized (the forward again), at peak, over 1 - the pipeline bubble; collectives: the bytes one device
  sends (aot.collective_traffic, loops by their trip counts) at the ring bandwidth. The step lies between
  full overlap (the larger) and none (the sum)."""
  from MaxText import train
  from MaxText.layers import pipeline
  from MaxText.runtime import aot, metrics
  peak, ring = metrics.peak_flops(device_kind), metrics.ring_bytes_per_s(device_kind)
  if not peak or not ring:
    return None
  flops = metrics.model_flops_per_token(config, train.active_params(config, r["total_parameters"]))
  flops *= r["tokens_per_step"] / r["num_devices"] * (4 / 3 if config.remat_policy != "none" else 1.0)
  bubble = pipeline.bubble_fraction(config) if config.pipeline_stages > 1 else 0.0
  compute = flops / peak / (1 - bubble)
  comm = aot.traffic_bytes(r["collective_traffic"]) / ring
  return {"device_kind": device_kind, "compute_s": compute, "collectives_s": comm, "bubble": bubble,
          "full_overlap_s": max(compute, comm), "no_overlap_s": compute + comm}


def _table(config, r: dict) -> str:
  from MaxText.runtime.aot import gib, report_table
  lora = [("  frozen base", f"{gib(r['base_bytes_per_device'])} (weight_quantization={config.weight_quantization})"),
          ("  LoRA adapters", f"{gib(r['adapter_bytes_per_device'])} (rank {config.lora_rank})")] if config.lora_rank else []
  return report_table(
      f"model {config.model_name}: train step of {r['tokens_per_step']:,} tokens on {r['num_devices']} devices "
      f"({{mesh}}); weights {config.weight_dtype}, compute {config.dtype}",
      [("parameters + buffers", f"{gib(r['parameter_bytes_per_device'])} per device"), *lora,
       ("trained parameters", f"{r['trainable_parameters']:,}"),
       ("optimizer state", gib(r["optimizer_bytes_per_device"])),
       ("temporaries", f"{gib(r['temp_bytes_per_device'])} (activations and the step's temporaries)")],
      r, after_peak=[("flops per step", f"{r['flops_per_step']:.3e}"), *_estimate_rows(r)])


def _estimate_rows(r: dict) -> list[tuple[str, str]]:
  est = r["step_estimate"]
  from MaxText.runtime.aot import traffic_bytes
  sent = traffic_bytes(r["collective_traffic"])
  rows = [("collective bytes", f"{sent / 2**30:.2f} GiB sent a device a step (loops by their trip counts)")]
  if est:
    rows.append(("step estimate", f"{_secs(est['full_overlap_s'])} - {_secs(est['no_overlap_s'])} on "
                 f"{est['device_kind']} (compute {_secs(est['compute_s'])} with a {est['bubble']:.0%} bubble; "
                 f"collectives {_secs(est['collectives_s'])})"))
  return rows


def _secs(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def main(argv) -> None:
  from MaxText.config import pyconfig
  from MaxText.runtime import virtual_devices
  if any(a in ("-h", "--help") for a in argv[1:]):
    pyconfig.initialize_or_exit(["python -m MaxText.train_compile", "--help"], __doc__)  # prints usage, exits 0
  devices = virtual_devices.setup_or_exit(argv)  # a TPU topology's, or None: virtual CPU devices
  config = pyconfig.initialize_or_exit(argv, __doc__, num_devices=len(devices) if devices else None)
  compiled, state, batch, seconds = compile_or_exit(config, devices)
  r = report(config, compiled, state, batch, seconds)
  print(_table(config, r), flush=True)
  print(json.dumps(r), flush=True)
  if config.compile_hbm_gib and r["peak_bytes_per_device"] > config.compile_hbm_gib * 2**30:
    print(f"error: needs {r['peak_bytes_per_device'] / 2**30:.2f} GiB per device, the limit is "
          f"{config.compile_hbm_gib:g} (compile_hbm_gib)", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  main(sys.argv)
