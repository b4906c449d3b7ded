"""Sparse MLA prefill: the mask path vs the gather path (MaxText/kernels/sparse_attention.py).

    python benchmarks/sparse_attention.py                 # t = s in 4K, 8K, 16K, 32K, k = 2048
    python benchmarks/sparse_attention.py --quick         # 2K and 4K, small enough for a minute
    python benchmarks/sparse_attention.py --sizes 4096,8192 --set num_query_heads=16 kv_lora_rank=512 --grad
    python benchmarks/sparse_attention.py --crossover     # the auto threshold: sizes 1K..8K

One MLA layer with the indexer (SHAPE; --set KEY=VALUE overrides), jitted whole (--grad: and its gradient), each
(path, size) in its own process. Prints per row the time, XLA's compiled peak memory and the max RSS (a path over
--mem-limit-gib is not run, its time extrapolated quadratically, labelled), then one JSON line. Never a timed assert.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30
SHAPE = dict(emb_dim=512, num_query_heads=32, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64,
             qk_rope_head_dim=32, v_head_dim=64, indexer_n_heads=8, indexer_head_dim=64, indexer_topk=2048,
             indexer_head_chunk=8, sparse_attention_query_block=256)


def shape(a) -> dict:
  """SHAPE under --set's KEY=VALUE pairs."""
  return {**SHAPE, **dict(kv.split("=", 1) for kv in a.set)}


def run_one(a, impl: str, t: int) -> dict:
  """In a subprocess: compile, check memory, run; returns a JSON-able row."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from MaxText.config import pyconfig
  from MaxText.layers.attention_mla import MLA
  from MaxText.runtime import aot

  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=1, **shape(a), sparse_attention_impl=impl,
                            max_target_length=t, max_prefill_length=t, max_position_embeddings=max(t, 4096),
                            original_max_position_embeddings=4096, rope_factor=40.0, ici_data_parallelism=1)
  mla = MLA(cfg, rngs=nnx.Rngs(0))
  assert mla.use_gather(t) == (impl == "gather")
  graphdef, params, rest = nnx.split(mla, nnx.Param, ...)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, t, cfg.emb_dim)), jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  r = jnp.asarray(rng.standard_normal((1, t, cfg.emb_dim)), jnp.float32)

  def forward(params, x, pos):
    out, aux = nnx.merge(graphdef, params, rest)(x, pos)
    return out, aux["indexer_loss"]

  if a.grad:
    def fn(params, x, pos):
      return jax.grad(lambda p, x: jnp.sum(forward(p, x, pos)[0] * r), argnums=(0, 1))(params, x)
  else:
    fn = forward
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(params, x, pos).compile()
  compile_s = time.perf_counter() - t0
  peak, temp = (aot.memory(compiled)[k] for k in ("peak", "temp"))  # arguments + outputs - aliased + temporaries
  row = {"impl": impl, "t": t, "compiled_peak": peak, "temp": temp, "compile_s": compile_s}
  print(json.dumps(row), flush=True)  # known even if running it gets the process killed
  if peak > a.mem_limit_gib * GIB:
    row["skipped"] = f"compiled peak {peak / GIB:.1f} GiB > --mem-limit-gib {a.mem_limit_gib}"
    return row
  times, cpu = [], []
  for i in range(a.warmup + a.repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(params, x, pos))
    if i >= a.warmup:
      times.append(time.perf_counter() - t0)
      cpu.append(time.process_time() - c0)
  row["time"], row["cpu"] = float(np.min(times)), float(np.min(cpu))
  row["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return row


def spawn(a, impl: str, t: int) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--one", impl, str(t)] + a.passthrough
  p = subprocess.run(cmd, capture_output=True, text=True)
  lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
  row = json.loads(lines[-1]) if lines else {"impl": impl, "t": t}
  if p.returncode:
    why = f"killed by signal {-p.returncode} (out of memory?)" if p.returncode < 0 else f"exit {p.returncode}"
    row["failed"] = why + "".join(f": {l}" for l in p.stderr.strip().splitlines()[-1:])
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="4096,8192,16384,32768", help="t = s values, comma-separated")
  p.add_argument("--quick", action="store_true", help="sizes 2048,4096, no warm-up run")
  p.add_argument("--crossover", action="store_true", help="sizes 1K..8K, to place sparse_attention_gather_min_length")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config values over SHAPE's")
  p.add_argument("--grad", action="store_true", help="time forward + backward instead of the forward")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
  p.add_argument("--mem-limit-gib", type=float, default=18.0, help="skip a run whose compiled peak exceeds this")
  p.add_argument("--one", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one:
    print(json.dumps(run_one(a, a.one[0], int(a.one[1]))))
    return
  a.passthrough = [x for x in sys.argv[1:] if x not in ("--quick", "--crossover")]
  if a.quick:
    a.sizes, a.passthrough = "2048,4096", a.passthrough + ["--warmup", "0"]
  if a.crossover:
    a.sizes = "1024,2048,3072,4096,6144,8192"
  sizes = [int(x) for x in a.sizes.split(",")]
  impls = ["mask", "gather"]
  print(f"one MLA layer + indexer: {shape(a)}; batch 1, fp32; "
        f"{'forward + backward' if a.grad else 'forward (prefill)'}; {os.cpu_count()} CPUs; "
        f"min of {a.repeats} run(s) after {a.warmup} warm-up")
  rows = {}
  for t in sizes:
    for impl in impls:
      rows[impl, t] = spawn(a, impl, t)
      print("  ", json.dumps(rows[impl, t]), file=sys.stderr, flush=True)
  report(rows, sizes, impls)
  print(json.dumps(dict(benchmark="sparse_attention", grad=a.grad, shape=shape(a), rows=list(rows.values()))))


def report(rows: dict, sizes: list[int], impls: list[str]) -> None:
  """The table: wall and CPU seconds, compiled peak and RSS, mask/gather ratios; a mask time the
  path could not run is extrapolated quadratically from its largest run (marked *)."""
  print(f"\n{'t=s':>6} | {'mask':^32} | {'gather':^32} | {'mask / gather':^13}")
  print(f"{'':>6} | {'wall s':>7} {'cpu s':>7} {'peak GiB':>8} {'RSS GiB':>7} | {'wall s':>7} {'cpu s':>7} "
        f"{'peak GiB':>8} {'RSS GiB':>7} | {'wall':>6} {'cpu':>6}")
  last, notes, extrapolated = None, [], False
  fmt_gib = lambda x: f"{x / GIB:.2f}" if x is not None else "-"  # noqa: E731
  num = lambda x, w, star=False: f"{'~' if star else ''}{x:.2f}{'*' if star else ''}".rjust(w) if x else "-".rjust(w)
  for t in sizes:
    m, g = rows.get(("mask", t), {}), rows.get(("gather", t), {})
    for r in (m, g):
      if "skipped" in r or "failed" in r:
        notes.append(f"{r['impl']} t={t}: {r.get('skipped') or r.get('failed')}")
    star = False
    if m.get("time"):
      last, m_wall, m_cpu = t, m["time"], m["cpu"]
    elif "mask" in impls and last:
      f = (t / last) ** 2
      m_wall, m_cpu, star = rows["mask", last]["time"] * f, rows["mask", last]["cpu"] * f, True
      extrapolated = True
    else:
      m_wall = m_cpu = None
    ratio = lambda x, y: (f"{x / y:.1f}x" + ("*" if star else "")) if x and y else "-"
    print(f"{t:>6} | {num(m_wall, 7, star)} {num(m_cpu, 7, star)} {fmt_gib(m.get('compiled_peak')):>8} "
          f"{fmt_gib(m.get('rss')):>7} | {num(g.get('time'), 7)} {num(g.get('cpu'), 7)} "
          f"{fmt_gib(g.get('compiled_peak')):>8} {fmt_gib(g.get('rss')):>7} | "
          f"{ratio(m_wall, g.get('time')):>6} {ratio(m_cpu, g.get('cpu')):>6}")
  for n in notes:
    print("note:", n)
  if extrapolated:
    print(f"* extrapolated, not measured: the mask path's time at t={last} times (t/{last})^2 (it is O(t*s)); "
          "its peak memory is XLA's compiled estimate")


if __name__ == "__main__":
  main()
