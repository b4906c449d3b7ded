"""Ahead-of-time compilation helpers: abstract (never allocated) sharded state, and what a compiled
program's HLO says about its collectives. Used by benchmarks and tests that measure memory at
scales this machine cannot hold (compile on virtual CPU devices, read `memory_analysis()`)."""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from MaxText.config.types import Config
from MaxText.runtime import sharding

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute",
               "ragged-all-to-all")


def topology_devices(name: str) -> list:
  """The devices of a TPU topology (e.g. "v5e:1x1", "v5p:8x8x4"), to compile for without one: the TPU compiler of
  libtpu (pip install libtpu==0.0.42.1, or --target DIR with DIR on PYTHONPATH), its memory analysis the chip's.
  A ValueError in one line without libtpu or for a topology it does not know."""
  from jax.experimental import topologies
  try:
    chips = [int(x) for x in name.split(":")[-1].split("x")]  # "v5e:2x2" -> one host's chips 2x2x1 (libtpu's default)
    bounds = tuple((chips + [1, 1, 1])[:3]) if math.prod(chips) <= 4 else (2, 2, 1)
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds,
                                             chip_config_name="default", num_slices=1).devices)
  except Exception as e:  # no libtpu, or a topology it does not know
    raise ValueError(f"no TPU compiler for topology {name!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                     "install libtpu aside (pip install --target DIR libtpu==0.0.42.1) and put DIR on "
                     "PYTHONPATH") from None


def abstract_module(make, config: Config, mesh: Mesh):
  """(graphdef, state) of the module `make()` builds, with ShapeDtypeStruct leaves carrying the
  shardings the config's rules give them; nothing is allocated."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  shardings = sharding.state_shardings(state, config, mesh)
  return graphdef, jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), state, shardings)


def abstract_array(shape, dtype, logical_axes, config: Config, mesh: Mesh) -> jax.ShapeDtypeStruct:
  spec = sharding.logical_to_spec(logical_axes, sharding.rules_of(config), mesh, shape)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def bytes_per_device(tree) -> int:
  """Bytes one device holds of the (abstract or real, sharded) arrays in tree (the largest shard, for
  uneven splits)."""
  total = 0
  for a in jax.tree.leaves(tree):
    sharding_ = getattr(a, "sharding", None)
    shape = sharding_.shard_shape(a.shape) if sharding_ is not None else a.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
  return total


def memory(compiled) -> dict[str, int]:
  """A compiled program's memory per device (bytes): its arguments, outputs, the outputs aliased to
  donated arguments, temporaries, and the peak = arguments + outputs - aliased + temporaries."""
  mem = compiled.memory_analysis()
  out = {"argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
         "alias": int(mem.alias_size_in_bytes), "temp": int(mem.temp_size_in_bytes)}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def _ops(line: str) -> list[str]:
  return [op for op in COLLECTIVES if re.search(rf"\s{op}(-start)?\(", line)]


def collective_counts(hlo: str) -> dict[str, int]:
  """Collective op -> how many times it appears in the compiled HLO text (async pairs count once)."""
  counts = Counter()
  for line in hlo.splitlines():
    for op in _ops(line):
      counts[op] += 1
  return dict(sorted(counts.items()))


def collective_sizes(hlo: str, op: str) -> list[int]:
  """Element count of every `op` result in the HLO text (of its largest array, for a tuple)."""
  sizes = []
  for line in hlo.splitlines():
    if op in _ops(line) and "=" in line:
      result_type = line.split("=", 1)[1].split(f" {op}")[0]
      shapes = re.findall(r"\[([\d,]*)\]", result_type)  # one per tuple element
      sizes.append(max((math.prod(int(v) for v in m.split(",") if v) for m in shapes), default=1))
  return sizes


# ---------------------------------------------------------------- the compile reports' tables


def report_table(title: str, rows: list[tuple[str, str]], r: dict, after_peak: tuple = ()) -> str:
  """A compile report's console table (train_compile, serve_compile): `title` with {mesh} filled from
  r["mesh"], each (label, value) row, then the rows every report has: peak (after_peak's rows follow
  it), collectives, compile time. r: the report's JSON object (peak_bytes_per_device, collectives,
  compile_seconds, mesh)."""
  mesh = " x ".join(f"{a} {v}" for a, v in r["mesh"].items() if v > 1) or "1 device"
  rows = [*rows, ("peak", gib(r["peak_bytes_per_device"])), *after_peak,
          ("collectives", ", ".join(f"{k} {v}" for k, v in r["collectives"].items()) or "none"),
          ("compiled in", f"{r['compile_seconds']:.1f} s")]
  return "\n".join([title.format(mesh=mesh)] + [f"  {label:<20} {value}" for label, value in rows])


def gib(b: int) -> str:
  """bytes as the reports print them: GiB, 9 wide, 2 decimals."""
  return f"{b / 2**30:9.2f} GiB"
