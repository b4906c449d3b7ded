"""The decode step compiled for a TPU on a host without one: what XLA's TPU compiler makes of it, offline.

    pip install --target /tmp/libtpu libtpu==0.0.42.1      # once: the TPU compiler (jax 0.10.2's), kept aside
    PYTHONPATH=/tmp/libtpu:. python benchmarks/tpu_compile.py --rows 16 --set serve_page_size=256
    PYTHONPATH=/tmp/libtpu:. python benchmarks/tpu_compile.py --rows 16 --set serve_page_size=256 weight_dtype=bfloat16

libtpu compiles for a TPU topology (jax.experimental.topologies, --topology, default "v5e:1x1") without the chip,
as MaxText's train_compile does: benchmarks/decode.py's engine (its model, --rows sequences of --context in
paged pools of the fp8 or f32 cache) is built from abstract parameters on that topology's devices, under the tpu
row of kernels/backend.py (so the Pallas kernels lower through Mosaic, as on the chip), and its decode step and
write are compiled: nothing runs and nothing is allocated. From the compiled step it reports

  1. XLA's own estimate of each op's cycles (the TPU cost model's `estimated_cycles`, over --clock-ghz), summed per
     part / source line / op with benchmarks/decode_profile.py's PARTS (profile_ops.tables): a map of where the
     step's work is, NOT a time: each op is counted once (a loop's trip count is not applied, a rarely taken
     branch counts in full) and the Pallas kernels (custom calls) carry no estimate;
  2. every op at the top of a computation (not inside a fusion) that writes a whole array of at least --min-mb:
     copies (a relayout of a weight or a pool), broadcasts, pads, transposes, concatenates: each is HBM traffic a
     fused program would not have, with its shape, layout and source line.

The chip's own figures come from benchmarks/decode_profile.py on it (docs/accelerators.md); this is the loop for
changing the step's HLO between device sessions. Prints the tables, then one JSON line. Without libtpu: one line
saying how to get it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_profile  # noqa: E402  (PARTS: a source line's part; config_of: decode.py's model)
import profile_ops  # noqa: E402

from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.kernels import backend  # noqa: E402
from MaxText.runtime import sharding  # noqa: E402

MATERIALIZING = ("copy", "broadcast", "pad", "transpose", "concatenate", "reduce")  # ops that write a whole array
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](\{[^}]*\})?\s+([\w\-]+)\(", re.M)


def topology_devices(name: str):
  """The devices of a TPU topology (e.g. "v5e:1x1"), compile-only; None (after one line) without libtpu."""
  from jax.experimental import topologies
  try:
    chips = [int(x) for x in name.split(":")[-1].split("x")]  # "v5e:2x2" -> one host's chips 2x2x1 (libtpu's default)
    bounds = tuple((chips + [1, 1, 1])[:3]) if math.prod(chips) <= 4 else (2, 2, 1)
    return topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds,
                                        chip_config_name="default", num_slices=1).devices
  except Exception as e:  # no libtpu, or a topology it does not know
    print(f"tpu_compile: no TPU compiler for topology {name!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
          f"install libtpu aside (pip install --target DIR libtpu==0.0.42.1) and put DIR on PYTHONPATH")
    return None


def estimated_ns(text: str, clock_ghz: float) -> dict:
  """{instruction name: ns} from a compiled TPU program's backend configs (estimated_cycles / clock)."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=.*\"estimated_cycles\":\"(\d+)\"", text, re.M):
    out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(2)) / clock_ghz
  return out


def fused_names(text: str) -> set:
  """The instructions inside fused computations (what a fusion computes in registers / VMEM, not HBM)."""
  names, inside = set(), False
  for line in text.splitlines():
    if re.match(r"^%?[\w.\-]+ .*\{$", line) or line.startswith("ENTRY"):
      inside = bool(re.match(r"^%?(fused_computation|[\w.\-]*fusion)[\w.\-]* ", line))
    elif inside:
      m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=", line)
      if m:
        names.add(m.group(1))
  return names


_CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")


def looped_names(text: str) -> set:
  """The instructions of computations a while loop runs (its body and condition, and what they call, to any
  depth): an op there runs once an iteration (a scanned stack's: once a layer), so a whole-array write in it
  costs L times a step."""
  comps, calls, comp = {}, {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{$", line)
    if head and not line.startswith(" "):
      comp = head.group(1)
      comps[comp], calls[comp] = set(), []
      continue
    op = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=", line)
    if comp is None or not op:
      continue
    comps[comp].add(op.group(1))
    for kind, targets in _CALLS.findall(line):
      names = [t.strip().lstrip("%") for t in targets.strip("{}").split(",") if t.strip()]
      calls[comp] += [(kind in ("body", "condition"), n) for n in names]
  looped = {n for c in calls for is_loop, n in calls[c] if is_loop}
  todo = list(looped)
  while todo:  # what a loop's computations call runs in the loop too
    for _, n in calls.get(todo.pop(), []):
      if n not in looped:
        looped.add(n)
        todo.append(n)
  return set().union(*(comps.get(c, set()) for c in looped))


def materialized(text: str, min_bytes: int) -> list[dict]:
  """The unfused ops of MATERIALIZING kinds writing >= min_bytes: [{op, kind, shape, layout, mb, in_loop}] largest
  first; in_loop: inside a while loop's computations (looped_names: once an iteration)."""
  inner, looped, out = fused_names(text), looped_names(text), []
  for m in _INSTR.finditer(text):
    name, dtype, dims, layout, kind = m.groups()
    if name in inner or kind not in MATERIALIZING or dtype not in _BYTES:
      continue
    n = math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
    if n >= min_bytes:
      out.append(dict(op=name, kind=kind, shape=f"{dtype}[{dims}]", layout=layout or "", mb=round(n / 1e6, 2),
                      in_loop=name in looped))
  return sorted(out, key=lambda r: -r["mb"])


def compile_step(args):
  """(step, write) compiled for the topology, or None without a TPU compiler."""
  devices = topology_devices(args.topology)
  if devices is None:
    return None
  cfg = decode_profile.config_of(args)
  mesh = sharding.create_mesh(cfg, devices)
  with backend.forced("tpu", **args.force), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers = model_state.abstract_on_mesh(cfg, mesh)
    engine = ServingEngine(cfg, graphdef, params, buffers, attention="sparse")
    step, write, _ = engine.compile_step(args.rows, 1)
  return step, write


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--context", type=int, default=131072)
  ap.add_argument("--cache-dtype", default="fp8", choices=["fp8", "float32", "bfloat16"])
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--layers", type=int, default=1, help="decoder layers (the pools stacked [L, N, n] past 1)")
  ap.add_argument("--force", nargs="*", default=[], metavar="NAME=VALUE",
                  help="kernels/backend.py choices other than the device's row (backend.forced), e.g. index_placement=grouped")
  ap.add_argument("--set", nargs="*", default=[], help="model config overrides key=value (serve_page_size=256, ...)")
  ap.add_argument("--topology", default="v5e:1x1")
  ap.add_argument("--clock-ghz", type=float, default=1.5, help="the TensorCore clock the cycles are read at (v5e)")
  ap.add_argument("--min-mb", type=float, default=4.0, help="the smallest whole-array write listed")
  ap.add_argument("--top", type=int, default=20)
  ap.add_argument("--hlo-out", default=None, help="a directory for the compiled step's and write's HLO text")
  args = ap.parse_args(argv)
  try:
    args.force = backend.parse_forced(args.force)
  except ValueError as e:
    ap.error(str(e))
  t0 = time.perf_counter()
  got = compile_step(args)
  if got is None:
    sys.exit(2)
  texts = [got[0].as_text(), got[1].as_text()]
  seconds = time.perf_counter() - t0
  if args.hlo_out:
    os.makedirs(args.hlo_out, exist_ok=True)
    for name, text in zip(("step", "write"), texts):
      with open(os.path.join(args.hlo_out, f"{name}_{args.rows}.hlo.txt"), "w") as f:
        f.write(text)
  print(f"{args.rows} rows x {args.context}, {args.cache_dtype} cache, top-k {args.topk}; {' '.join(args.set)}; "
        f"forced {args.force}; "
        f"compiled for {args.topology} in {seconds:.0f} s (nothing run)")
  ops = {**estimated_ns(texts[0], args.clock_ghz), **estimated_ns(texts[1], args.clock_ghz)}
  customs = len(re.findall(r'custom_call_target="tpu_custom_call"', texts[0] + texts[1]))
  parts = profile_ops.tables(ops, texts, decode_profile.PARTS, 1, args.top, 200,
                             f"XLA's estimate at {args.clock_ghz} GHz (each op once; {customs} Pallas calls not in it)")
  rows = materialized(texts[0], int(args.min_mb * 1e6)) + [dict(r, program="write")
                                                           for r in materialized(texts[1], int(args.min_mb * 1e6))]
  sources = profile_ops.hlo_sources(texts)
  print(f"\nwhole arrays written outside fusions (>= {args.min_mb} MB; loop: once an iteration of a while loop, "
        f"a scanned stack's layer): {len(rows)}")
  for r in rows:
    frames = profile_ops.ours(sources.get(r["op"], []))
    r["source"] = f"{'/'.join(frames[0][0].split('/')[-2:])}:{frames[0][2]} {frames[0][1]}" if frames else ""
    r["estimated_ms"] = round(ops.get(r["op"], 0.0) / 1e6, 4)
    print(f"{r['mb']:>9.1f} MB {r['estimated_ms']:>8.3f} ms  {'loop' if r['in_loop'] else '':>4} {r['kind']:>11} "
          f"{r['shape']}{r['layout']}  {r['source']}")
  print(json.dumps(dict(benchmark="tpu_compile", topology=args.topology, rows=args.rows, context=args.context,
                        cache_dtype=args.cache_dtype, overrides=args.set, forced=args.force, compile_seconds=round(seconds, 1),
                        estimated_ms=round(sum(ops.values()) / 1e6, 3), pallas_calls=customs, parts=parts,
                        materialized=rows)))


if __name__ == "__main__":
  main()
