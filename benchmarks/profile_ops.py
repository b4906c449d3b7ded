"""Device time of a compiled program by the source line that made each op: jax.profiler's trace
(its XSpace, read with jax.profiler.ProfileData: no TensorBoard or xprof needed) joined with the
compiled HLO's metadata (each instruction's stack frame: file, function, line).

`summarize(trace_dir, hlo_texts, parts, steps, top)` prints three tables (per part, per source line,
per op with its HLO line) and returns the per-part rows; `tables` does the same for any {op: ns}
(benchmarks/tpu_compile.py: XLA's estimated cycles of a program compiled for a TPU it does not run on). A part is named by `parts`: (part, file
suffix, function names or None) triples, the first match over the op's frames in MaxText/ (innermost
first) wins; an op no triple names is "other: <its innermost file>". Used by
benchmarks/decode_profile.py and benchmarks/train_mfu.py.
"""

from __future__ import annotations

import collections
import glob
import os
import re


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


def summarize(trace_dir: str, hlo_texts: list[str], parts, steps: int, top: int = 25, hlo_chars: int = 240
              ) -> list[dict]:
  """The newest trace under trace_dir, its device ops per part / source line / op (module doc);
  times per step (the trace held `steps` steps). Returns [{part, ms}] largest first."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  ops, planes = device_ops(files[-1])
  print(f"trace: {files[-1]} ({os.path.getsize(files[-1]) / 1e6:.1f} MB); planes read: {planes}")
  return tables(ops, hlo_texts, parts, steps, top, hlo_chars, "device time")


def tables(ops: dict, hlo_texts: list[str], parts, steps: int, top: int = 25, hlo_chars: int = 240,
           what: str = "device time") -> list[dict]:
  """ops {op name: ns} (a trace's, or a compiled program's estimates: benchmarks/tpu_compile.py) per part / source
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
  print(f"\n{'part':>32} {'ms':>9}  source line (top {top})")
  for (part, where), ns in by_line.most_common(top):
    print(f"{part:>32} {ns / steps / 1e6:>9.3f}  {where}")
  print(f"\n{'part':>32} {'ms':>9}  op: its HLO (top {top})")
  for (part, op), ns in by_op.most_common(top):
    print(f"{part:>32} {ns / steps / 1e6:>9.3f}  {op}: {lines.get(op, '?')[:hlo_chars]}")
  return out
