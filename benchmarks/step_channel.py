"""What multi-process serving adds to a step: process 0's message to the other processes (step_channel.py).

    PYTHONPATH=. .venv/bin/python benchmarks/step_channel.py [--bytes 16384] [--n 200] [--lockstep]

Two processes on localhost (jax.distributed, gloo). Prints the median of --n of the channel's send, a round trip
and broadcast_one_to_all of the same bytes (--lockstep: each process's Lockstep check), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.serve_load import free_port


def _process(pid: int, port: int, size: int, n: int, lockstep: bool = False) -> None:
  """One of the two processes; lockstep: each times its Lockstep check of the same call n times and prints
  {"lockstep_<pid>_ms": median}."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from MaxText.inference import step_channel
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", 2, pid)
  channel = step_channel.open_channel(60, lockstep=lockstep)
  client = channel.client
  feed = np.zeros(size // 4, np.int32)
  if lockstep:
    times = []
    for _ in range(n):
      t = time.perf_counter()
      channel.send("step", 8, feed)
      times.append(time.perf_counter() - t)
    print(json.dumps({f"lockstep_{pid}_ms": round(statistics.median(times) * 1e3, 3)}), flush=True)
    channel.close()
    return
  send, round_trip, broadcast = [], [], []
  for i in range(n):
    if pid == 0:
      t = time.perf_counter()
      channel.send("step", 8, feed)
      send.append(time.perf_counter() - t)
      t = time.perf_counter()
      channel.send("step", 8, feed)
      client.blocking_key_value_get(f"bench/ack/{i}", 60_000)
      round_trip.append(time.perf_counter() - t)
    else:
      channel.receive()
      channel.receive()
      client.key_value_set(f"bench/ack/{i}", "1")
  multihost_utils.broadcast_one_to_all(feed)  # compiled once
  for _ in range(n):
    t = time.perf_counter()
    multihost_utils.broadcast_one_to_all(feed)
    broadcast.append(time.perf_counter() - t)
  if pid == 0:
    ms = {k: statistics.median(v) * 1e3 for k, v in (("send_ms", send), ("round_trip_ms", round_trip),
                                                      ("broadcast_ms", broadcast))}
    print(json.dumps({"bytes": size, "n": n} | {k: round(v, 3) for k, v in ms.items()}), flush=True)
  channel.close()
  if pid != 0:
    channel.receive()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--bytes", type=int, default=16384)
  ap.add_argument("--n", type=int, default=200)
  ap.add_argument("--lockstep", action="store_true", help="time RL's Lockstep check instead")
  ap.add_argument("--role", type=int, default=-1, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.role >= 0:
    _process(args.role, args.port, args.bytes, args.n, args.lockstep)
    return
  port = free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_ENABLE_COMPILATION_CACHE": "false"}
  procs = [subprocess.Popen([sys.executable, __file__, "--role", str(i), "--port", str(port), "--bytes",
                             str(args.bytes), "--n", str(args.n)] + ["--lockstep"] * args.lockstep, env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  result = {"bytes": args.bytes, "n": args.n}
  for out in outs if args.lockstep else outs[:1]:  # each process's median (--lockstep), else process 0's
    result |= json.loads(out.strip().splitlines()[-1])
  title = f"Lockstep check of a {args.bytes}-byte call" if args.lockstep else f"per message of {args.bytes} bytes"
  rows = ((("lockstep_0_ms", "process 0: encode + digest + store write"),
           ("lockstep_1_ms", "process 1: encode + digest + read of process 0s + compare")) if args.lockstep else
          (("send_ms", "step_channel send (encode + store write)"),
           ("round_trip_ms", "send + follower receive + answer"),
           ("broadcast_ms", "multihost_utils.broadcast_one_to_all")))
  print(f"{title + f' (median of {args.n})':<60} ms")
  for key, what in rows:
    print(f"{what:<60} {result[key]:.3f}")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
