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


# Bytes of one element by HLO type name (the integer and float widths XLA prints; pred is a byte).
_HLO_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """HLO text -> ({computation name: its instruction lines}, the ENTRY computation's name)."""
  comps, entry, name = {}, "", None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      name = m.group(1)
      comps[name] = []
      entry = name if line.startswith("ENTRY") else entry
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def _trip_count(cond: list[str]) -> int | None:
  """Iterations of a while loop from its condition (`counter < constant`, the form a jax scan or fori_loop
  lowers to, counter from 0), None for any other form."""
  consts = dict(re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((-?\d+)\)", "\n".join(cond)))
  for line in cond:
    m = re.search(r"ROOT .* compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT", line)
    if m and m.group(1) in consts:
      return int(consts[m.group(1)])
  return None


def _array_bytes(result_type: str) -> list[float]:
  """Bytes of each array in an HLO result type (a tuple's elements in order)."""
  out = []
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result_type):
    if dtype in _HLO_BYTES:
      out.append(_HLO_BYTES[dtype] * math.prod(int(v) for v in dims.split(",") if v))
  return out


def _group_size(line: str, num_devices: int) -> int:
  """Participants of one collective from its replica_groups ({{0,1},{2,3}}, [groups,size]<=[...], or
  mesh[...] {'axes'}); num_devices where the groups are empty (all devices)."""
  if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
    return len(m.group(1).split(","))
  if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
    return int(m.group(1))
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):
    sizes = dict((a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
  return num_devices


def _bytes_moved(op: str, line: str, num_devices: int) -> float:
  """Bytes one device sends over the interconnect for one collective, by the ring algorithm over its group of n:
  all-gather and all-to-all (n-1)/n of the result, all-reduce 2(n-1)/n of it, reduce-scatter (n-1) x the
  (scattered) result, a permute the whole. An async `-start`'s tuple holds operands beside results: all-gather's
  results are n/(n+1) of it, a permute's half."""
  result_type = line.split("=", 1)[1].split(f" {op}")[0]
  sizes = _array_bytes(result_type)
  n = _group_size(line, num_devices)
  start = f" {op}-start(" in line
  if op == "collective-permute":
    return (sum(s for s in sizes if s > 4) / 2) if start else sum(sizes)
  b = sum(sizes)
  if op == "all-gather":
    return (b * n / (n + 1) if start else b) * (n - 1) / n
  if op == "all-reduce":
    return 2 * b * (n - 1) / n
  if op == "reduce-scatter":
    return b * (n - 1)
  return b * (n - 1) / n  # all-to-all, ragged-all-to-all


def collective_traffic(hlo: str, num_devices: int) -> dict[str, dict[str, float]]:
  """Collective op -> {"count", "bytes"} that one device executes and sends in one run of the compiled program:
  each while loop's body counted by its trip count (a layer scan's collectives once per layer; XLA's cost
  analysis counts a body once), called computations once. Loops whose trip count the HLO does not state count
  once, under "loops_without_trip_count"."""
  comps, entry = _computations(hlo)
  unknown = [0]
  memo: dict[str, dict] = {}

  def total(name: str) -> dict[str, list[float]]:
    if name in memo:
      return memo[name]
    acc: dict[str, list[float]] = {}
    memo[name] = acc  # a recursive reference (none in XLA's output) counts nothing
    for line in comps.get(name, ()):
      for op in _ops(line):
        c = acc.setdefault(op, [0, 0.0])
        c[0] += 1
        c[1] += _bytes_moved(op, line, num_devices)
      if " while(" in line:
        body = re.search(r"body=%([\w.\-]+)", line).group(1)
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        trips = int(m.group(1)) if m else _trip_count(comps.get(re.search(r"condition=%([\w.\-]+)", line).group(1), []))
        unknown[0] += trips is None
        callees = [(body, trips or 1)]
      else:
        callees = [(c, 1) for c in re.findall(r"(?:calls|true_computation|false_computation)=%([\w.\-]+)", line)]
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
          callees += [(c, 1) for c in re.findall(r"%([\w.\-]+)", group)]
      for callee, k in callees:
        for op, (count, b) in total(callee).items():
          c = acc.setdefault(op, [0, 0.0])
          c[0] += k * count
          c[1] += k * b
    return acc

  out = {op: {"count": int(c), "bytes": float(b)} for op, (c, b) in sorted(total(entry).items())}
  if unknown[0]:
    out["loops_without_trip_count"] = {"count": unknown[0], "bytes": 0.0}
  return out


def traffic_bytes(traffic: dict[str, dict[str, float]]) -> float:
  """Bytes one device sends over all collectives of a collective_traffic result."""
  return sum(v["bytes"] for k, v in traffic.items() if k in COLLECTIVES)


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
