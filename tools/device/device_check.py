"""The prepared check for one accelerator (an H200 in about 8 minutes), which also runs on the CPU
at small sizes. Run it as `bash tools/device/device_check.sh` (docs/accelerators.md).

Each section runs in its own process (an accelerator's memory is held per process) under its own
time limit; one that fails or runs out of time is reported and the others still run. A section
picks its sizes from the backend (SIZES: "cpu", or "accelerator" for any other):

  tests      the unit tests marked `device` (pytest -m device tests/unit)
  mfu_tiny   the train step of the tiny default model: FLOPs from the compiled step's cost
             analysis / step time / the device's peak (metrics.PEAK_FLOPS; on the CPU a measured
             f32 matmul). Layers unscanned (scan_layers=false): the cost analysis counts a loop's
             body once. Rematerialized recompute is counted (the FLOPs the device ran). model_mfu
             is the same with 6 x active params + attention (what train.py logs as mfu).
  mfu_large  the same for the largest config of a ladder that fits one device (the compiled
             step's memory analysis against the device's memory, before anything is allocated)
  selection  exact and approximate top-k masks at f32[1,1024,131072], k=2048: ours (the binned
             selection, kernels/backend.py forced) vs lax.top_k vs lax.approx_max_k
  decode     one decode step at 128K context, sparse vs dense (benchmarks/decode.py)
  serving    benchmarks/serving.py --quick (a one-point speculative ladder): its JSON line
  readme_*   the README's own commands as a user runs them (readme_check.py): train (the loss falls, the
             process exits), decode from that run, the chat server (a completion and a chat; SIGTERM), a LoRA
             SFT served by adapter name; v5e_train: the v5e model file trained by train.py's defaults

Prints progress on stderr, then a table and one JSON line on stdout; each section's own output is
in --out (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("readme_check", os.path.join(os.path.dirname(__file__), "readme_check.py"))
readme_check = importlib.util.module_from_spec(_spec)  # beside this file (tools/device is no package)
_spec.loader.exec_module(readme_check)

RESULT = "DEVICE_CHECK_RESULT "  # a section's one result line on its stdout


def _wide(layers: int, experts: int) -> dict:
  """The 671B model's layer shapes (MLA, indexer, dense MLP, experts of 2048), its vocabulary,
  1 dense layer then MoE layers of `experts` routed experts (8 active), no MTP."""
  return dict(model_name="deepseek3.2-671b", num_decoder_layers=layers, first_num_dense_layers=1,
              num_experts=experts, mtp_num_layers=0, weight_dtype="float32", dtype="bfloat16",
              max_target_length=2048, max_prefill_length=2048, global_batch_size=2)


SIZES = {
    "cpu": dict(
        tests=dict(args=["tests/unit/test_backend.py"], workers=0),  # the whole marked set: CI runs it
        tiny=dict(overrides={}, steps=3),
        large=[("small: emb 256, 4 layers, 8 experts, 4 x 256 tokens",
                dict(emb_dim=256, mlp_dim=512, moe_mlp_dim=128, num_query_heads=8, q_lora_rank=64, kv_lora_rank=64,
                     indexer_n_heads=8, indexer_topk=64, global_batch_size=4, max_target_length=256,
                     max_prefill_length=256, mtp_num_layers=0))],
        large_steps=3,
        selection=dict(shape=(1, 128, 16384), k=512, repeats=3),
        decode=dict(contexts=[4096], topk=512, iters=3),
    ),
    "accelerator": dict(
        tests=dict(args=["tests/unit"], workers=4),
        tiny=dict(overrides=dict(dtype="bfloat16"), steps=10),
        # Largest first; compiled memory decides. f32 weights and AdamW moments: 83, 64 and 35 GiB
        # (XLA:CPU's memory analysis of the first, 4 x 2048 tokens, added 201 GiB of temporaries).
        large=[("671B layer shapes: 1 dense + 3 MoE layers of 32 experts, 2 x 2048 tokens", _wide(4, 32)),
               ("671B layer shapes: 1 dense + 2 MoE layers of 32 experts, 2 x 2048 tokens", _wide(3, 32)),
               ("671B layer shapes: 1 dense + 1 MoE layer of 16 experts, 2 x 2048 tokens", _wide(2, 16))],
        large_steps=5,
        selection=dict(shape=(1, 1024, 131072), k=2048, repeats=7),
        decode=dict(contexts=[131072], topk=2048, iters=5),
    ),
}
README_SECTIONS = tuple(readme_check.SECTIONS)
LIMITS = {"cpu": dict(tests=300, mfu_tiny=240, mfu_large=300, selection=240, decode=300, serving=300,
                      readme_train=400, readme_decode=200, readme_serve=400, readme_lora=600, v5e_train=30),
          "accelerator": dict(tests=480, mfu_tiny=150, mfu_large=240, selection=120, decode=120, serving=240,
                              readme_train=300, readme_decode=180, readme_serve=300, readme_lora=420, v5e_train=400)}
BUDGET = {"cpu": 2400, "accelerator": 2400}  # seconds for all sections: a section gets what is left, at most its limit
SECTIONS = ("tests", "mfu_tiny", "mfu_large", "selection", "decode", "serving") + README_SECTIONS


def _sizes(backend: str) -> dict:
  return SIZES["cpu" if backend == "cpu" else "accelerator"]


def _emit(result: dict) -> None:
  print(RESULT + json.dumps(result), flush=True)


# ---------------------------------------------------------------- sections (each in its own process)


def probe() -> dict:
  import jax
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  return dict(backend=jax.default_backend(), device_kind=dev.device_kind, device_count=jax.device_count(),
              jax=jax.__version__, memory_bytes=stats.get("bytes_limit"))


def train_step(overrides: dict, steps: int, trace_dir: str | None = None, compile_only: bool = False) -> dict:
  """Compile the train step of train.py (from abstract inputs), check it fits, then run it. trace_dir:
  2 more steps under jax.profiler.trace there, and the compiled step's HLO text under "hlo" (for
  benchmarks/profile_ops.summarize). compile_only: the memory figures alone (nothing allocated)."""
  import jax
  import numpy as np

  from MaxText import train
  from MaxText.config import pyconfig
  from MaxText.runtime import metrics, sharding

  cfg = pyconfig.initialize(["device_check", "base.yml"], num_devices=1, ici_data_parallelism=1, scan_layers=False,
                            enable_checkpointing=False, enable_tensorboard=False, **overrides)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    abs_state, abs_batch, step_fn = train.abstract_train_step(cfg, mesh)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if os.environ.get("DEVICE_CHECK_MEMORY_GIB"):  # pretend a device of this size (to try the ladder)
      limit = float(os.environ["DEVICE_CHECK_MEMORY_GIB"]) * 2**30
    t0 = time.perf_counter()
    try:
      compiled = step_fn.lower(abs_state, abs_batch).compile()
    except Exception as e:  # a TPU refuses to compile what does not fit HBM (a GPU compiles and reports it)
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      need = re.search(r"required for HLO temporaries \(([\d.]+)G\)", str(e))
      return dict(fits=False, peak_gib=float(need.group(1)) if need else None,
                  limit_gib=round(limit / 2**30, 2) if limit else None, compile_error="RESOURCE_EXHAUSTED")
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abs_state["params"]))
    out = dict(params=n_params, tokens=cfg.global_batch_size * cfg.max_target_length, compile_s=round(compile_s, 1),
               peak_gib=round(peak_bytes / 2**30, 2), limit_gib=round(limit / 2**30, 2) if limit else None)
    if limit and peak_bytes > limit:
      return dict(out, fits=False)
    if compile_only:
      return dict(out, fits=True, temp_gib=round(mem.temp_size_in_bytes / 2**30, 2),
                  argument_gib=round(mem.argument_size_in_bytes / 2**30, 2))
    cost = compiled.cost_analysis()
    flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
    _, state, _, _ = train.init_state(cfg, mesh)
    rng = np.random.default_rng(0)
    b, t = cfg.global_batch_size, cfg.max_target_length
    tokens = rng.integers(3, cfg.vocab_size, (b, t + 1))
    host = train.prepare_batch(cfg, dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones((b, t), np.int32),
                                         positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
                                         weights=np.ones((b, t), np.float32)))
    batch = {k: jax.device_put(v.astype(abs_batch[k].dtype), abs_batch[k].sharding) for k, v in host.items()}
    times = []
    for i in range(steps + 1):  # the first: warm-up
      t0 = time.perf_counter()
      state, m = compiled(state, batch)
      loss = float(jax.device_get(m["loss"]))
      if i:
        times.append(time.perf_counter() - t0)
    if trace_dir:
      with jax.profiler.trace(trace_dir):
        for _ in range(2):
          state, m = compiled(state, batch)
          jax.block_until_ready(m["loss"])
      out["hlo"] = compiled.as_text()
  step_s = statistics.median(times)
  peak, source = metrics.peak_flops_per_device()
  model_flops = metrics.model_flops_per_token(cfg, train.active_params(cfg, n_params)) * out["tokens"]
  return dict(out, fits=True, step_ms=round(step_s * 1e3, 2), loss=round(loss, 4), flops=flops,
              tflops_per_s=round(flops / step_s / 1e12, 3), mfu=round(flops / step_s / peak, 4),
              model_mfu=round(model_flops / step_s / peak, 4), peak_tflops=round(peak / 1e12, 3), peak_source=source)


def mfu_tiny(backend: str) -> dict:
  s = _sizes(backend)
  return dict(config="tiny (configs/base.yml)", **train_step(s["tiny"]["overrides"], s["tiny"]["steps"]))


def mfu_large(backend: str) -> dict:
  s = _sizes(backend)
  tried = []
  for name, overrides in s["large"]:
    r = train_step(overrides, s["large_steps"])
    if r["fits"]:
      return dict(config=name, tried_first=tried, **r)
    tried.append(f"{name}: {r['peak_gib']} GiB > {r['limit_gib']} GiB")
  return dict(config=None, tried_first=tried, fits=False)


def selection(backend: str) -> dict:
  import jax
  import jax.numpy as jnp

  sys.path.insert(0, os.path.join(REPO, "benchmarks"))
  import indexer_topk

  from MaxText.kernels import backend as kernel_backend

  s = _sizes(backend)["selection"]
  k = s["k"]
  x = jax.random.normal(jax.random.key(0), s["shape"], jnp.float32)
  every = indexer_topk.methods(k, 0.95)
  picked = {"lax.top_k + mask": every["top_k + threshold mask (baseline)"],
            "ours exact (binned)": every["ours exact fused: topk_mask"],
            "lax.approx_max_k + mask": every["approx_max_k + index mask"],
            "ours approx (binned)": every["ours approx fused: topk_mask(approx)"]}
  timed = indexer_topk.time_all(picked, x, s["repeats"])
  exact = timed["lax.top_k + mask"][3]
  rows = {name: dict(median_ms=round(med, 2), min_ms=round(best, 2), recall=round(float((m & exact).sum() / exact.sum()), 4))
          for name, (med, best, _, m) in timed.items()}
  return dict(shape=list(s["shape"]), k=k, rows=rows, this_backend=dict(
      exact=kernel_backend.choice("exact_selection"), approx=kernel_backend.choice("approx_selection")))


def _last_json(text: str) -> dict | None:
  lines = [ln for ln in text.splitlines() if ln.startswith("{")]
  return json.loads(lines[-1]) if lines else None


def decode(backend: str) -> dict:
  s = _sizes(backend)["decode"]
  cmd = [sys.executable, "benchmarks/decode.py", "--contexts", *map(str, s["contexts"]),
         "--topk", str(s["topk"]), "--iters", str(s["iters"])]
  p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
  print(p.stdout + p.stderr, flush=True)
  got = _last_json(p.stdout)
  if p.returncode or got is None:
    raise RuntimeError(f"benchmarks/decode.py exited {p.returncode} with no JSON line")
  return dict(command=" ".join(cmd[1:]), **got)


def serving(backend: str) -> dict:
  script = os.path.join(REPO, "benchmarks", "serving.py")
  if not os.path.exists(script):
    return dict(note="no serving benchmark yet (benchmarks/serving.py)")
  # --quick with a one-point speculative ladder (2 layers, 100 training steps, one run): the full ladder trains a
  # 12-layer model at 5 checkpoints x 3 repeats (over 15 min on the CPU), past this section's limit.
  args = ["--quick", "--spec-layers", "2", "--spec-checkpoints", "100", "--spec-repeats", "1"]
  p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=REPO)
  print(p.stdout + p.stderr, flush=True)
  got = _last_json(p.stdout)
  if p.returncode or got is None:
    raise RuntimeError(f"benchmarks/serving.py exited {p.returncode} with no JSON line")
  return dict(note="ran benchmarks/serving.py", **got)


def run_section(name: str, backend: str, out: str) -> None:
  if name in readme_check.SECTIONS:
    work = os.path.join(out, "readme_work")  # one folder: decode and the LoRA SFT use readme_train's run
    os.makedirs(work, exist_ok=True)
    return _emit(readme_check.SECTIONS[name]("cpu" if backend == "cpu" else "accelerator", work))
  fn = {"probe": lambda _: probe(), "mfu_tiny": mfu_tiny, "mfu_large": mfu_large, "selection": selection,
        "decode": decode, "serving": serving}[name]
  _emit(fn(backend))


# ---------------------------------------------------------------- the driver (no jax here)


def _child(args: list[str], log: str, limit: float, env: dict | None = None) -> tuple[str, float, str]:
  """Run a child with a time limit, its output into `log`: (status, seconds, output)."""
  t0 = time.perf_counter()
  with open(log, "w") as f:
    p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    try:
      rc = p.wait(timeout=limit)
      status = "ok" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, 9)
      p.wait()
      status = f"timeout ({limit:.0f} s)"
  with open(log) as f:
    return status, time.perf_counter() - t0, f.read()


def _section(name: str, backend: str, out: str, limit: float) -> dict:
  status, secs, text = _child([sys.executable, os.path.abspath(__file__), "--section", name, "--backend", backend,
                               "--out", out], os.path.join(out, f"{name}.log"), limit)
  results = [ln[len(RESULT):] for ln in text.splitlines() if ln.startswith(RESULT)]
  got = json.loads(results[-1]) if results else {}
  if status == "ok" and not results:
    status = "no result"
  if status == "ok" and got.get("ok") is False:
    status = "failed"
  if status not in ("ok", "failed"):  # a failed section says why in its result
    tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
    got["error"] = " | ".join(tail)[-300:]
  return dict(got, status=status, seconds=round(secs, 1))


def _tests(backend: str, out: str, limit: float) -> dict:
  s = _sizes(backend)["tests"]
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  args = [sys.executable, "-m", "pytest", "-m", "device", "-q", "-p", "no:cacheprovider", *s["args"]]
  if s["workers"] and backend != "tpu":  # a TPU: one process holds the chip
    args += ["-n", str(s["workers"])]
  status, secs, text = _child(args, os.path.join(out, "tests.log"), limit, env)
  counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
  failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
  if status == "exit 1" and counts.get("failed"):
    status = "failures"
  return dict(status=status, seconds=round(secs, 1), command=" ".join(args[1:]), counts=counts, failed=failed[:10])


def _fmt(name: str, r: dict) -> str:
  """One table row's figures."""
  if "error" in r and r.get("status") not in ("ok", "failures", "failed"):
    return r["error"]
  if name in readme_check.SECTIONS:
    return readme_check.fmt(name, r)
  if name == "tests":
    c = r["counts"]
    return ", ".join(f"{c[w]} {w}" for w in ("passed", "failed", "errors", "error", "skipped") if w in c) + \
        (f"; failed: {' '.join(r['failed'])}" if r["failed"] else "")
  if name.startswith("mfu"):
    if not r.get("fits"):
      return "nothing in the ladder fits: " + "; ".join(r.get("tried_first", []))
    return (f"{r['config']}: {r['params'] / 1e6:,.1f}M params, {r['tokens']} tokens, step {r['step_ms']} ms, "
            f"{r['tflops_per_s']} TFLOP/s compiled; MFU {r['mfu']:.2%} (model FLOPs {r['model_mfu']:.2%}) of "
            f"{r['peak_tflops']} TFLOP/s [{r['peak_source']}]; peak memory {r['peak_gib']} GiB")
  if name == "selection":
    rows = "; ".join(f"{n} {v['median_ms']} ms (recall {v['recall']})" for n, v in r["rows"].items())
    return f"f32{r['shape']} k={r['k']}: {rows}; this backend runs {r['this_backend']}"
  if name == "decode":
    return "; ".join(f"{row['context']} context: sparse {row['sparse_ms']} ms, dense {row['dense_ms']} ms "
                     f"({row['dense_ms'] / row['sparse_ms']:.1f}x)" for row in r["rows"])
  return r.get("note", "")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--section", choices=("probe",) + SECTIONS[1:], help=argparse.SUPPRESS)
  ap.add_argument("--backend", help=argparse.SUPPRESS)
  ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run only these sections")
  ap.add_argument("--out", default=None, help="folder for each section's log and results.json, rewritten after "
                  "each section (default: a new temporary one)")
  ap.add_argument("--budget", type=float, default=None, help="seconds for all sections (default: 2400 on an "
                  "accelerator and on the CPU); a section that would start with under 20 s left is skipped")
  args = ap.parse_args()
  if args.section:
    return run_section(args.section, args.backend, args.out)

  out = args.out or tempfile.mkdtemp(prefix="device_check_")
  os.makedirs(out, exist_ok=True)
  t0 = time.perf_counter()
  device = _section("probe", "", out, 120)
  backend = device.get("backend", "cpu")
  kind = "cpu" if backend == "cpu" else "accelerator"
  print(f"device check on {device.get('device_kind')} ({backend}, jax {device.get('jax')}); sizes: {kind}; "
        f"logs in {out}", file=sys.stderr, flush=True)
  deadline = t0 + (args.budget or BUDGET[kind])
  results = {}
  for name in args.only:
    limit = min(LIMITS[kind][name], deadline - time.perf_counter())
    if limit < 20:
      results[name] = dict(status="skipped", seconds=0, error="out of time (--budget)")
    else:
      results[name] = _tests(backend, out, limit) if name == "tests" else _section(name, backend, out, limit)
    print(f"  {name}: {results[name]['status']} in {results[name]['seconds']} s", file=sys.stderr, flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:  # what a run stopped from outside still leaves
      json.dump(dict(device=device, sections=results), f)
  total = time.perf_counter() - t0

  print(f"device check: {device.get('device_kind')} ({backend}, {device.get('device_count')} device(s), "
        f"jax {device.get('jax')}), {total:.0f} s")
  print(f"{'section':<14} {'status':<14} {'s':>6}  figures")
  for name, r in results.items():
    print(f"{name:<14} {r['status']:<14} {r['seconds']:>6}  {_fmt(name, r)}")
  print(json.dumps(dict(device=device, seconds=round(total, 1), sections=results)))


if __name__ == "__main__":
  main()
