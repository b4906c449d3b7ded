"""Restoring past a corrupt newest checkpoint, with and without checkpoint/read_scope (issue 46): how often the
abandoned reads of the failed attempt print into the console, and what owning them costs in restore time.

    .venv/bin/python benchmarks/checkpoint_fallback.py [--arrays 12] [--rows 64] [--repeats 10]

A state of --arrays float32 parameters (rows x 32*(i+1)), each sharded over 8 simulated CPU devices, is saved at
steps 1 and 2. After a warm-up restore of each variant, each repeat restores a fresh copy with both, each first
in turn: `owned` is orbax_state.restore_newest_good as shipped, `bare` the same function without its read_scope
(its __wrapped__).
Cases: `good` (step 2 intact), `cut` (step 2's largest data file cut in half: the fallback to step 1).
A repeat is noisy when anything matching a traceback or asyncio's complaints reaches stderr (file descriptor 2,
where TensorStore's threads write too), sys.unraisablehook or the asyncio logger, until 0.05 s after the restore
and a garbage collection. Times are wall time on a shared CPU: compare the two columns of one row.
"""

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from MaxText.checkpoint import orbax_state  # noqa: E402

NOISE = ("Traceback", "Exception ignored", "Event loop is closed", "never retrieved", "destroyed but it is pending")
VARIANTS = {"owned": orbax_state.restore_newest_good, "bare": orbax_state.restore_newest_good.__wrapped__}


def save_state(folder: str, arrays: int, rows: int):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rng = np.random.default_rng(0)
  host = {"params": {f"w{i}": rng.standard_normal((rows, 32 * (i + 1)), np.float32) for i in range(arrays)},
          "step": np.int32(1)}
  manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False,
                                                                                create=True))
  for step in (1, 2):
    state = jax.tree.map(lambda x, s=step: jax.device_put(x + (s - 1), split if x.ndim == 2 else whole), host)
    orbax_state.save(manager, step, state, {"position": step})
  manager.close()
  return orbax_state.abstract_like(state, jax.tree.map(lambda a: a.sharding, state))


def cut_largest_data_file(step_dir: str) -> None:
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
           if os.sep + "d" + os.sep in os.path.join(d, f)]
  path = max(files, key=os.path.getsize)
  os.truncate(path, os.path.getsize(path) // 2)


class Heard:
  """What reaches fd 2, sys.unraisablehook and the asyncio logger while open (and 0.05 s after, collected)."""

  def __enter__(self):
    self.file = tempfile.TemporaryFile()
    sys.stderr.flush()
    self.saved_fd = os.dup(2)
    os.dup2(self.file.fileno(), 2)
    self.ignored = []
    self.saved_hook, sys.unraisablehook = sys.unraisablehook, lambda u: self.ignored.append("Exception ignored")
    self.handler = logging.Handler()
    self.handler.emit = lambda record: self.ignored.append(record.getMessage())
    logging.getLogger("asyncio").addHandler(self.handler)
    return self

  def __exit__(self, *exc):
    time.sleep(0.05)
    gc.collect()
    sys.stderr.flush()
    os.dup2(self.saved_fd, 2)
    os.close(self.saved_fd)
    sys.unraisablehook = self.saved_hook
    logging.getLogger("asyncio").removeHandler(self.handler)
    self.file.seek(0)
    said = self.file.read().decode(errors="replace") + "\n".join(self.ignored)
    self.noisy = any(n in said for n in NOISE)


def run(pristine: str, abstract, case: str, variant: str, work: str) -> tuple[float, bool]:
  shutil.rmtree(work, ignore_errors=True)
  shutil.copytree(pristine, os.path.join(work, "checkpoints"))
  if case == "cut":
    cut_largest_data_file(os.path.join(work, "checkpoints", "2"))
  manager = ocp.CheckpointManager(os.path.join(work, "checkpoints"), options=ocp.CheckpointManagerOptions())
  with Heard() as heard:
    start = time.perf_counter()
    step, _, _ = VARIANTS[variant](manager, abstract, report=lambda _: None)
    seconds = time.perf_counter() - start
    manager.close()
  assert step == (1 if case == "cut" else 2), step
  return seconds, heard.noisy


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--arrays", type=int, default=12)
  p.add_argument("--rows", type=int, default=64, help="rows of each parameter (a multiple of 8)")
  p.add_argument("--repeats", type=int, default=10)
  args = p.parse_args()
  logging.getLogger("absl").setLevel(logging.ERROR)
  root = tempfile.mkdtemp(prefix="checkpoint_fallback_")
  try:
    abstract = save_state(os.path.join(root, "pristine"), args.arrays, args.rows)
    rows = []
    for case in ("good", "cut"):
      got = {v: [] for v in VARIANTS}
      for variant in VARIANTS:  # warm-up (compiles the fingerprint program), not counted
        run(os.path.join(root, "pristine"), abstract, case, variant, os.path.join(root, "w"))
      for i in range(args.repeats):
        for variant in sorted(VARIANTS, reverse=i % 2 == 1):  # each goes first in half the repeats
          got[variant].append(run(os.path.join(root, "pristine"), abstract, case, variant, os.path.join(root, "w")))
      rows.append({"case": case, **{f"{v}_s": round(statistics.median(t for t, _ in got[v]), 4) for v in VARIANTS},
                   **{f"{v}_noisy": sum(n for _, n in got[v]) for v in VARIANTS}, "repeats": args.repeats})
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f"{'case':<6} {'owned s':>9} {'bare s':>9} {'owned/bare':>10} {'owned noisy':>12} {'bare noisy':>11}")
  for r in rows:
    print(f"{r['case']:<6} {r['owned_s']:>9.4f} {r['bare_s']:>9.4f} {r['owned_s'] / r['bare_s']:>10.2f} "
          f"{r['owned_noisy']:>8}/{r['repeats']:<3} {r['bare_noisy']:>7}/{r['repeats']:<3}")
  print(json.dumps({"benchmark": "checkpoint_fallback", "arrays": args.arrays, "rows": args.rows, "results": rows}))


if __name__ == "__main__":
  main()
