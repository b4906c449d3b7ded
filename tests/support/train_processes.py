"""train.py / decode.py as subprocesses: start them (one or several joined by jax.distributed), wait with a
timeout, kill them with -9 once a checkpoint is complete, read their printed losses. Shared by the multi-process
tests (tests/integration/test_multiprocess.py) and LoRA's kill-and-resume test (test_lora_train.py)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

TIMEOUT = 420  # seconds a run may take (compile included) before it counts as hung


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(script, args, *, processes, devices, cache, per_process=None, port=None, timeout_s=60):
  """Starts `processes` copies of `python MaxText/<script> args` (each with `devices` CPU devices,
  joined through jax.distributed when several); per_process[i]: extra args of process i."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO_ROOT,
         # not FAST_COMPILE_FLAGS' elemental emitters: with them an 8-device process stalls in a
         # collective (its 40 s rendezvous timeout)
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
         "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  if processes > 1:
    # No persistent cache for a multi-process run: JAX writes entries from process 0 only and the processes'
    # keys differ, so process 0 loaded its programs while process 1 compiled them, ran ahead, and timed out
    # in gloo's 30 s context rendezvous (GetKeyValue DEADLINE_EXCEEDED at step 1) on a loaded host.
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  port = port or free_port()
  procs = []
  for i in range(processes):
    dist = [] if processes == 1 else [f"distributed_coordinator_address=localhost:{port}",
                                      f"distributed_num_processes={processes}", f"distributed_process_id={i}",
                                      f"distributed_initialization_timeout={timeout_s}"]
    extra = (per_process or {}).get(i, [])
    procs.append(subprocess.Popen([sys.executable, f"MaxText/{script}", *args, *dist, *extra], cwd=REPO_ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return procs


def finish(procs, timeout=TIMEOUT):
  """[(returncode, stdout, stderr)] of every process; all are killed if one outlives the timeout."""
  deadline, out = time.time() + timeout, []
  try:
    for p in procs:
      o, e = p.communicate(timeout=max(deadline - time.time(), 1))
      out.append((p.returncode, o, e))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"a process ran past {timeout} s (hung peer?): " + " | ".join(p.communicate()[1][-800:] for p in procs))
  return out


def ok(results):
  for i, (rc, o, e) in enumerate(results):
    assert rc == 0, f"process {i} exited {rc}:\n{o[-2000:]}\n{e[-3000:]}"
  return results


def kill_after_checkpoint(procs, ckpt, step: int, steps: int, timeout=TIMEOUT) -> tuple[list[str], int]:
  """SIGKILLs every process once checkpoint `step` (or a later one) is complete in `ckpt` (no orbax tmp folder
  left); (each process's stdout until then, the newest checkpoint on disk, asserted in [step, steps))."""
  deadline = time.time() + timeout
  done = lambda: [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []  # noqa: E731
  while time.time() < deadline and all(p.poll() is None for p in procs):
    if any(s >= step for s in done()) and not any("tmp" in n for n in os.listdir(ckpt)):
      break
    time.sleep(0.05)
  for p in procs:
    p.send_signal(signal.SIGKILL)
  out = [p.communicate()[0] for p in procs]
  latest = max(done(), default=0)
  assert step <= latest < steps, f"checkpoint {latest}: the run ended (or never reached step {step}) before the kill"
  return out, latest


def losses(out: str) -> dict[int, float]:
  """{step: loss} of a train.py console log (4 decimals)."""
  return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+ \| loss (\S+)", out)}
