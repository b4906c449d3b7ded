"""Context parallelism on simulated CPU devices: per-device peak memory and train-step time for cp = 1..8.

    .venv/bin/python benchmarks/context_parallel.py [--seq 8192] [--cps 1 2 4 8] [--repeats 2]
    .venv/bin/python benchmarks/context_parallel.py --seq 131072 --compile-only   # memory only, 128K

Runs the tiny model's full train step (forward + backward + AdamW) with the sequence sharded
over `context` (zig-zag load balancing on). Per-device memory is the compiled program's
memory analysis (arguments + outputs + temporaries of one device); step time is wall time on
this 2-core CPU, where the simulated devices share the cores: it shows the cost of the
collectives, not a speed-up. --compile-only reports the memory without running a step (compiling
needs no device memory), so sequences too long to run on this machine still get their column.
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from MaxText import train  # noqa: E402
from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data import input_pipeline
from MaxText.runtime import sharding
from MaxText.runtime.optimizers import create_optimizer  # noqa: E402


def measure(seq: int, cp: int, repeats: int, extra: list[str], compile_only: bool = False):
  cfg = pyconfig.initialize(["bench", "base.yml", f"max_target_length={seq}", "global_batch_size=1",
                             "mtp_num_layers=0", "ici_data_parallelism=1", f"ici_context_parallelism={cp}",
                             f"max_position_embeddings={max(seq, 128)}", "indexer_topk=256", *extra],
                            num_devices=cp)
  mesh = sharding.create_mesh(cfg, jax.devices()[:cp])
  with mesh, sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    tx = create_optimizer(cfg, train.trainable_labels(cfg, params))
    state = {"params": params, "buffers": buffers, "opt_state": jax.jit(tx.init)(params),
             "step": np.int32(0)}
    batch = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg)))
    batch = jax.device_put(batch, train.batch_shardings(cfg, mesh, batch))
    step = jax.jit(train.make_train_step(cfg, graphdef, tx))
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    per_device = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    if compile_only:
      return per_device, mem.temp_size_in_bytes, None
    out = compiled(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(compiled(state, batch))
      times.append(time.perf_counter() - t)
  return per_device, mem.temp_size_in_bytes, float(np.median(times))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--compile-only", action="store_true", help="per-device memory only; run no step")
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  args = ap.parse_args()
  print(f"tiny model, seq {args.seq}, batch 1, indexer_topk 256, train step (fwd+bwd+AdamW); "
        f"{os.cpu_count()} CPUs shared by the simulated devices; median of {args.repeats} step(s)")
  print(f"{'cp':>3} {'per-device MiB':>15} {'temp MiB':>10} {'vs cp=1':>8} {'step s':>8}")
  base = None
  for cp in args.cps:
    total, temp, secs = measure(args.seq, cp, args.repeats, args.overrides, args.compile_only)
    base = base or total
    step = "-" if secs is None else f"{secs:.2f}"
    print(f"{cp:>3} {total / 2**20:>15.1f} {temp / 2**20:>10.1f} {total / base:>8.3f} {step:>8}", flush=True)


if __name__ == "__main__":
  main()
