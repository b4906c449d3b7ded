"""Device time of a compiled program by the source line that made each op: jax.profiler's trace
(read with jax.profiler.ProfileData) joined with the compiled HLO's metadata (file, function, line).

`summarize(trace_dir, hlo_texts, parts, steps, top)` prints tables per part, per source line and per op and
returns the per-part rows; `tables` does the same for any {op: ns}; `compiled_report` reads a program compiled
for a TPU it does not run on (XLA's estimated cycles, the whole arrays written outside fusions). A part is the
first (part, file suffix or a tuple of them, function names or None) triple of `parts` matching the op's
innermost MaxText frame; else "other: <file>". Used by benchmarks/decode_profile.py and benchmarks/train_mfu.py.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re

from MaxText.runtime import aot


def ours(frames: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
  """The frames in this repository's MaxText/ (innermost first), else all of them."""
  return [f for f in frames if "/MaxText/" in f[0]] or frames


def part_of(frames: list[tuple[str, str, int]], parts) -> str:
  """A source line's part: the first of our frames (innermost first) that PARTS names, else its file."""
  for file, func, _ in ours(frames):
    names = set(func.replace("<locals>", "").split("."))
    for part, suffix, funcs in parts:
      if file.endswith(suffix) and (funcs is None or names & set(funcs)):
        return part
  return "other: " + "/".join(ours(frames)[0][0].split("/")[-2:]) if frames else "other"


def _table(text: str, name: str) -> dict:
  """One of a compiled HLO text's tables (FileNames, FunctionNames, FileLocations, StackFrames): {id: rest}."""
  m = re.search(rf"^{name}\n((?:\d+ .*\n)*)", text, re.M)
  return {} if not m else {int(a): b for a, b in (ln.split(" ", 1) for ln in m.group(1).splitlines())}


def hlo_sources(hlo_texts: list[str]) -> dict:
  """{instruction name: [(file, function, line), ...] innermost frame first} from compiled HLO texts
  (each instruction's metadata stack_frame_id through the module's stack frame tables)."""
  out = {}
  for text in hlo_texts:
    files = {i: v.strip('"') for i, v in _table(text, "FileNames").items()}
    funcs = {i: v.strip('"') for i, v in _table(text, "FunctionNames").items()}
    locs = {}
    for i, v in _table(text, "FileLocations").items():
      f = dict(re.findall(r"(\w+)=(\d+)", v))
      locs[i] = (files.get(int(f.get("file_name_id", 0)), ""), funcs.get(int(f.get("function_name_id", 0)), ""),
                 int(f.get("line", 0)))
    frames = {i: tuple(int(x) for x in re.findall(r"=(\d+)", v)[:2]) for i, v in _table(text, "StackFrames").items()}

    def chain(i):
      got, seen = [], set()
      while i in frames and i not in seen:
        seen.add(i)
        loc, parent = frames[i]
        got.append(locs.get(loc, ("", "", 0)))
        i = parent
      return got

    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?stack_frame_id=(\d+)", text, re.M):
      out.setdefault(m.group(1), chain(int(m.group(2))))
  return out


def hlo_lines(hlo_texts: list[str]) -> dict:
  """{instruction name: its HLO line, shapes first} (the top-level and fused computations alike)."""
  out = {}
  for text in hlo_texts:
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", text, re.M):
      out.setdefault(m.group(1), re.sub(r",?\s*metadata=\{[^}]*\}", "", m.group(2)))
  return out


def device_ops(xplane: str) -> tuple[dict, str]:
  """{op name: total ns} of the device planes' op lines (the XLA ops line on a TPU/GPU; the CPU's
  thunks with an hlo_op stat), and which planes were read."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xplane)
  totals = collections.Counter()
  read = []
  for plane in data.planes:
    device = plane.name.startswith("/device:")
    for line in plane.lines:
      if device and line.name not in ("XLA Ops",):
        continue
      n = 0
      for e in line.events:
        stats = dict(e.stats)
        if device or "hlo_op" in stats:
          totals[stats.get("hlo_op", e.name) if not device else e.name] += e.duration_ns
          n += 1
      if n:
        read.append(f"{plane.name}:{line.name}")
  return dict(totals), ", ".join(sorted(set(read)))


def summarize(trace_dir: str, hlo_texts: list[str], parts, steps: int, top: int = 25) -> list[dict]:
  """The newest trace under trace_dir, its device ops per part / source line / op;
  times per step (the trace held `steps` steps). Returns [{part, ms}] largest first."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  ops, planes = device_ops(files[-1])
  print(f"trace: {files[-1]} ({os.path.getsize(files[-1]) / 1e6:.1f} MB); planes read: {planes}")
  return tables(ops, hlo_texts, parts, steps, top, 240, "device time")


def tables(ops: dict, hlo_texts: list[str], parts, steps: int, top: int = 25, hlo_chars: int = 240,
           what: str = "device time") -> list[dict]:
  """ops {op name: ns} (a trace's, or a compiled program's estimates: decode_profile --compile-for) per part / source
  line / op, per step (ops summed over `steps` steps); prints the three tables. Returns [{part, ms}] largest first."""
  sources, lines = hlo_sources(hlo_texts), hlo_lines(hlo_texts)
  by_line, by_part, by_op = collections.Counter(), collections.Counter(), collections.Counter()
  for op, ns in ops.items():
    base = op.split(" ")[0].lstrip("%")
    frames = sources.get(base, [])
    part = part_of(frames, parts)
    file, func, line = ours(frames)[0] if frames else ("", "", 0)
    by_line[(part, f"{'/'.join(file.split('/')[-2:])}:{line} {func}" if file else base)] += ns
    by_op[(part, base)] += ns
    by_part[part] += ns
  total = sum(by_part.values()) / steps / 1e6
  print(f"\n{what} per step: {total:.3f} ms (ops summed; {steps} steps)")
  print(f"{'part':>32} {'ms':>9} {'share':>6}")
  out = []
  for part, ns in by_part.most_common():
    ms = ns / steps / 1e6
    print(f"{part:>32} {ms:>9.3f} {ms / total:>6.1%}")
    out.append(dict(part=part, ms=round(ms, 4)))
  for what, by, text in (("source line", by_line, str), ("op: its HLO", by_op,
                                                        lambda op: f"{op}: {lines.get(op, '?')[:hlo_chars]}")):
    print(f"\n{'part':>32} {'ms':>9}  {what} (top {top})")
    for (part, key), ns in by.most_common(top):
      print(f"{part:>32} {ns / steps / 1e6:>9.3f}  {text(key)}")
  return out


MATERIALIZING = ("copy", "broadcast", "pad", "transpose", "concatenate", "reduce")  # ops that write a whole array
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](\{[^}]*\})?\s+([\w\-]+)\(", re.M)


def topology_devices(name: str):
  """The devices of a TPU topology (e.g. "v5e:1x1"), compile-only (runtime/aot.py); None (after one line) without
  libtpu."""
  try:
    return aot.topology_devices(name)
  except ValueError as e:
    print(f"decode_profile --compile-for: {e}")
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


def compiled_report(texts: list[str], clock_ghz: float, parts, top: int, min_mb: float) -> dict:
  """A program compiled for a TPU it does not run on (texts: the step's and write's HLO): XLA's estimated cycles at
  clock_ghz per part / source line / op (`tables`: each op once, a loop's trip count not applied, the Pallas calls
  not in it: a map of the work, not a time), and every whole array written outside a fusion of >= min_mb
  (`materialized`), each with its source line. Prints both; returns them for the JSON line."""
  ops = {**estimated_ns(texts[0], clock_ghz), **estimated_ns(texts[1], clock_ghz)}
  customs = len(re.findall(r'custom_call_target="tpu_custom_call"', texts[0] + texts[1]))
  got = tables(ops, texts, parts, 1, top, 200, f"XLA's estimate at {clock_ghz} GHz (each op once; {customs} Pallas "
               "calls not in it)")
  rows = materialized(texts[0], int(min_mb * 1e6)) + [dict(r, program="write")
                                                      for r in materialized(texts[1], int(min_mb * 1e6))]
  sources = hlo_sources(texts)
  print(f"\nwhole arrays written outside fusions (>= {min_mb} MB; loop: once an iteration of a while loop, "
        f"a scanned stack's layer): {len(rows)}")
  for r in rows:
    frames = ours(sources.get(r["op"], []))
    r["source"] = f"{'/'.join(frames[0][0].split('/')[-2:])}:{frames[0][2]} {frames[0][1]}" if frames else ""
    r["estimated_ms"] = round(ops.get(r["op"], 0.0) / 1e6, 4)
    print(f"{r['mb']:>9.1f} MB {r['estimated_ms']:>8.3f} ms  {'loop' if r['in_loop'] else '':>4} {r['kind']:>11} "
          f"{r['shape']}{r['layout']}  {r['source']}")
  return dict(estimated_ms=round(sum(ops.values()) / 1e6, 3), pallas_calls=customs, parts=got, materialized=rows)
