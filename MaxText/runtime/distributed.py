"""One program, many processes: jax.distributed start-up, each process's rows of the global batch,
host reads of global arrays, and failing fast together.

Every process runs the same command. `initialize` (called by pyconfig before anything reads the
device count) joins them: with `distributed_coordinator_address` set, process 0 checks first, over
a plain socket on that port, that every process came with the same `distributed_num_processes` and
a distinct `distributed_process_id` (a mistake is one line naming the key, within
`distributed_initialization_timeout`, where jax.distributed would abort with a stack trace);
with it empty, JAX's own cluster detection (SLURM, Open MPI, Cloud TPU pods) decides, and nothing
detected means one process.

Each process then builds only its rows of each batch (`batch_slice` tells the input pipeline
which) and `global_batch` assembles the global arrays from them without any host seeing the
whole batch. A failure in one process ends every process quickly and non-zero (`run_main`).
Host-side gathers and reads of collective programs' results go through `process_allgather` and
`settled`: the host never launches a collective program while another is still running on one of
its devices (on the CPU that aborts gloo: `settled`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
import traceback

from MaxText.config.types import ConfigError, Distributed

_ANSWER_BYTES = 1 << 16


def _cluster_detected():
  """The cluster environment JAX's initialize() would bootstrap from (its name and, where it has one,
  its class), or None."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS", None
  from jax._src import clusters  # the detectors jax.distributed.initialize() itself consults
  for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001 - jax keeps its detectors private
    if not env.opt_in_only_method and env.is_env_present():
      return env.__name__, env
  return None


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0]


_ONE_OR_MANY = ("for one process set distributed_num_processes=1; for several, "
                "distributed_coordinator_address=host:port with distributed_num_processes and "
                "distributed_process_id on each")


def _detected_processes(name: str, env) -> int | None:
  """How many processes the detected environment names (None: it does not say without a
  coordinator, e.g. JAX_COORDINATOR_ADDRESS). A probe that fails (a TPU host whose metadata server
  is unreachable: no network, a container, a machine outside GCE) is a ConfigError naming the keys
  that choose one process or a coordinator."""
  if env is None:
    return None
  try:
    workers = getattr(env, "_get_worker_list_in_slice", None)  # a TPU slice's hosts (jax's TPU clusters)
    if workers is not None:  # its slices from the environment (jax asks the metadata server for them too)
      return len(workers()) * int(os.environ.get("MEGASCALE_NUM_SLICES") or 1)
    return int(env.get_process_count())
  except Exception as e:  # noqa: BLE001 - any failure of the probe is the same answer to the user
    raise ConfigError(f"a {name} cluster environment was detected but asking it for the process count "
                      f"failed ({type(e).__name__}: {_first_line(e)[:200]}); {_ONE_OR_MANY}") from None


def initialize(d: Distributed) -> int:
  """Starts jax.distributed when the keys (or the environment) ask for several processes;
  returns the global device count. Idempotent; raises ConfigError naming the key on a mistake.

  One process never starts jax.distributed (it needs no coordinator): distributed_num_processes=1
  (with or without an address), or no address and either no cluster environment or one that names
  a single process (a one-host TPU VM, a 1-task SLURM job). Several: the address's rendezvous, or
  the detected environment's own bootstrap (its failure one line naming the keys, not a traceback)."""
  import jax
  if jax.distributed.is_initialized():
    return jax.device_count()
  n, pid, address = d.distributed_num_processes, d.distributed_process_id, d.distributed_coordinator_address
  timeout = d.distributed_initialization_timeout
  if n == 1:  # (the schema holds distributed_process_id to -1 or 0 then)
    return jax.device_count()
  if not address:
    detected = _cluster_detected()
    if detected is None:
      if n > 1:
        raise ConfigError(f"distributed_num_processes={n} needs distributed_coordinator_address=host:port "
                          "(no cluster environment such as SLURM, Open MPI or a TPU pod was detected)")
      return jax.device_count()
    name, env = detected
    if n < 0 and _detected_processes(name, env) == 1:
      return jax.device_count()
    _use_gloo_on_cpu(jax)
    try:
      jax.distributed.initialize(num_processes=None if n < 0 else n, process_id=None if pid < 0 else pid,
                                 initialization_timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the environment's bootstrap failed: one line, the keys that decide
      raise ConfigError(f"jax.distributed could not start from the detected {name} environment "
                        f"({type(e).__name__}: {_first_line(e)[:200]}); {_ONE_OR_MANY}") from None
    _quiet_unless_main(jax)
    return jax.device_count()
  _rendezvous(address, n, pid, timeout)
  _use_gloo_on_cpu(jax)
  jax.distributed.initialize(address, n, pid, initialization_timeout=timeout)
  _quiet_unless_main(jax)
  return jax.device_count()


def _use_gloo_on_cpu(jax) -> None:
  # CPU collectives across processes need an implementation; gloo ships with jaxlib. Must be set
  # before the CPU client exists; harmless on GPU/TPU hosts (it only concerns the CPU backend).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _quiet_unless_main(jax) -> None:
  # Process 0 speaks for all on the console: the others' stdout (fd 1: print, streams bound early,
  # native libraries) goes nowhere; stderr stays, for errors.
  if jax.process_index() != 0:
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


# ---------------------------------------------------------------- the pre-flight check


def _rendezvous(address: str, n: int, pid: int, timeout: float) -> None:
  """Process 0 listens on the coordinator's port until the other n-1 processes have told it
  (num_processes, process_id); any disagreement, or a process missing at the deadline, is a
  ConfigError in every process that got that far. The port is then free for jax.distributed."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout
  if pid == 0:
    _rendezvous_host(int(port), n, timeout, deadline, address)
  else:
    _rendezvous_peer(host, int(port), n, pid, timeout, deadline, address)


def _rendezvous_host(port: int, n: int, timeout: float, deadline: float, address: str) -> None:
  try:
    srv = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
        if socket.has_dualstack_ipv6() else socket.create_server(("", port))
  except OSError as e:
    raise ConfigError(f"distributed_coordinator_address={address!r}: process 0 cannot listen on port {port} "
                      f"({e.strerror}): another program holds it, or distributed_process_id=0 is given twice") from None
  peers: dict[int, socket.socket] = {}
  error = None
  with srv:
    while len(peers) < n - 1 and error is None:
      srv.settimeout(max(deadline - time.monotonic(), 0.001))
      try:
        conn, _ = srv.accept()
      except socket.timeout:
        missing = sorted(set(range(1, n)) - set(peers))
        error = (f"distributed_num_processes={n}: process(es) {missing} did not reach the coordinator "
                 f"{address} within distributed_initialization_timeout={timeout} s (started? same "
                 "distributed_coordinator_address?)")
        break
      conn.settimeout(max(deadline - time.monotonic(), 0.001))
      try:
        hello = json.loads(conn.recv(_ANSWER_BYTES).decode())
        their_n, their_id = int(hello["num_processes"]), int(hello["process_id"])
      except (OSError, ValueError, KeyError):
        conn.close()  # not one of ours (a port scanner, a stale client): ignore it
        continue
      if their_n != n:
        error = (f"distributed_num_processes differs: process {their_id} has {their_n}, process 0 has {n}; "
                 "give every process the same value")
      elif their_id == 0 or their_id in peers:
        error = f"distributed_process_id={their_id} is given to two processes; each needs its own id in 0 .. {n - 1}"
      if error is not None:
        _answer(conn, error)
        break
      peers[their_id] = conn
    for conn in peers.values():
      _answer(conn, error)
  if error is not None:
    raise ConfigError(error)


def _answer(conn: socket.socket, error: str | None) -> None:
  try:
    conn.sendall(json.dumps({"error": error}).encode())
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the peer closes first: no TIME_WAIT left on the coordinator's port
  except OSError:
    pass
  conn.close()


def _rendezvous_peer(host: str, port: int, n: int, pid: int, timeout: float, deadline: float, address: str) -> None:
  while True:
    try:
      conn = socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 5.0), 0.001))
      break
    except OSError:
      if time.monotonic() >= deadline:
        raise ConfigError(f"distributed_coordinator_address={address!r}: no process 0 answered within "
                          f"distributed_initialization_timeout={timeout} s (is it started, and the address "
                          "reachable from this host?)") from None
      time.sleep(0.1)
  with conn:
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
      conn.sendall(json.dumps({"num_processes": n, "process_id": pid}).encode())
      answer = json.loads(conn.recv(_ANSWER_BYTES).decode())
    except socket.timeout:
      raise ConfigError(f"distributed_num_processes={n}: not every process reached the coordinator {address} "
                        f"within distributed_initialization_timeout={timeout} s") from None
    except (OSError, ValueError) as e:
      raise ConfigError(f"distributed_coordinator_address={address!r}: the coordinator broke off the "
                        f"start-up check ({e})") from None
  if answer.get("error"):
    raise ConfigError(answer["error"])


_VERDICT_GRACE_S = 1.0  # process 0 outlives the others' config error by this much: the store they read is its


def check_same_config(values: dict, timeout_s: float, own=("distributed_process_id",)) -> None:
  """Several processes: raises ConfigError on every process (one line naming the keys) unless every
  process's config `values` equals process 0's, every key but `own` (each process's own). Through
  jax.distributed's key-value store: each process publishes its values; process 0 compares and publishes
  its verdict; each other process reads it and says it has; process 0, on a difference, waits for those
  acknowledgements (so every process prints the line before process 0, which hosts the store, exits).
  Each wait is bounded by timeout_s. Called before anything compiles. One process: nothing."""
  import jax
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # the store jax.distributed.initialize started
  client, me, n = jax_distributed.global_state.client, jax.process_index(), jax.process_count()
  ms = int(timeout_s * 1000)
  text = json.dumps({k: v for k, v in values.items() if k not in own}, sort_keys=True, default=str)
  client.key_value_set(f"maxtext_config/{me}", text)
  if me == 0:
    mine, verdict = json.loads(text), ""
    for other in range(1, n):
      try:
        theirs = json.loads(client.blocking_key_value_get(f"maxtext_config/{other}", ms))
      except Exception:  # noqa: BLE001 - the store's deadline: that process never got this far
        verdict = (f"process {other} did not publish its config within distributed_initialization_timeout="
                   f"{timeout_s:g} s (it failed earlier: see its output)")
        break
      differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
      if differ:
        shown = ", ".join(f"{k}={_short(mine.get(k))} on process 0, {_short(theirs.get(k))} on process {other}"
                          for k in differ[:4])
        verdict = (f"the processes were started with different configs ({len(differ)} key(s) differ: {shown}"
                   f"{', ...' if len(differ) > 4 else ''}): give every process the same command")
        break
    client.key_value_set("maxtext_config/verdict", verdict)
    if verdict:
      for other in range(1, n):
        with contextlib.suppress(Exception):  # a process gone already: do not wait for it again
          client.blocking_key_value_get(f"maxtext_config/seen/{other}", ms)
      time.sleep(_VERDICT_GRACE_S)  # they print their line and exit; then the store may go
  else:
    try:
      verdict = client.blocking_key_value_get("maxtext_config/verdict", ms)
    except Exception:  # noqa: BLE001 - the store's deadline
      verdict = f"process 0 did not compare the configs within distributed_initialization_timeout={timeout_s:g} s"
    client.key_value_set(f"maxtext_config/seen/{me}", "1")
  if verdict:
    raise ConfigError(verdict)


def _short(value, most: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= most else text[:most - 3] + "..."


# ---------------------------------------------------------------- batches and host reads


def batch_slice(sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
  """(index, count): this process feeds rows [index * B/count, (index+1) * B/count) of a global
  batch [B,...] laid out by `sharding`: the rows its devices hold. count is the process count
  when every process holds other rows, fewer when processes share rows (the sequence split
  across them): those then load the same rows."""
  b = global_shape[0]
  spans = sorted({(idx[0].start or 0, b if idx[0].stop is None else idx[0].stop)
                  for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values()})
  start, stop = spans[0][0], max(s for _, s in spans)
  covered = start
  for s, e in spans:
    if s > covered:
      break
    covered = max(covered, e)
  rows = stop - start
  if covered < stop or b % rows or start % rows:
    raise ValueError(f"this process's devices hold rows {spans} of the batch: not one contiguous block of "
                     "B / k rows; order the mesh so each process's devices are neighbours on the batch axes")
  return start // rows, b // rows


def batch_rows(config, mesh) -> dict:
  """create_data_iterator's process_index / process_count for this process: the block of rows of
  the global batch its devices hold under the "activation_batch" rule (train.batch_shardings)."""
  from jax.sharding import NamedSharding

  from MaxText.runtime import sharding
  b = config.global_batch_size
  spec = sharding.logical_to_spec(("activation_batch",), sharding.rules_of(config), mesh, (b,))
  index, count = batch_slice(NamedSharding(mesh, spec), (b,))
  return {"process_index": index, "process_count": count}


def global_batch(local: dict, shardings: dict, global_batch_size: int) -> dict:
  """This process's rows [B/count, ...] of each array -> global jax.Arrays [B, ...] (no host holds them all)."""
  import jax
  return {k: jax.make_array_from_process_local_data(shardings[k], v, (global_batch_size,) + v.shape[1:])
          for k, v in local.items()}


def from_host_copy(arrays, shardings):
  """Global jax.Arrays (a pytree, `shardings` a matching one) from a host copy of the WHOLE value that every
  process holds alike (RL's batch: each process assembles it from the same rollouts; LoRA adapters read from a
  checkpoint): each process places only its own devices' blocks. No transfer between processes and no check
  (jax.device_put of a numpy array onto a multi-process sharding would allgather it to compare): the caller
  proves the copies equal (step_channel.Lockstep) or read them from one file."""
  import jax
  return jax.tree.map(lambda v, s: jax.make_array_from_callback(v.shape, s, lambda index: v[index]), arrays, shardings)


def settled(tree):
  """`tree` once every array in it is computed on every local device (jax.block_until_ready), returned.

  The host waits here after a program with cross-process collectives and before it launches another
  program that does not consume that one's outputs. Reading a replicated result (float(loss), a
  fingerprint, multihost_utils.process_allgather's answer) waits for ONE local device's copy only, and
  XLA:CPU orders the LAUNCHES of collective programs, not their completion (cpu_client.h: "launching
  only one collective at a time"): the next program may start on a device whose part of the previous
  one is still exchanging gloo messages, and two programs' messages that meet in another order in each
  process are what gloo aborts on ("Received data size doesn't match expected size ... distributed
  collective mismatch", the two-process data-mesh test's flake; not reproduced in isolation). With every
  host-launched collective program settled, a process has one in flight at a time. On one process, and
  on TPU/GPU, this costs one wait at a checkpoint or eval and changes nothing else."""
  import jax
  return jax.block_until_ready(tree)


def _identity(x):
  return x


def process_allgather(x, tiled: bool = False):
  """jax.experimental.multihost_utils.process_allgather, settled: -> numpy once every local device is done
  with the gather (that one returns after ONE device's copy is read). x: a global jax.Array (tiled: its
  whole value) or this process's numpy rows ([processes, ...] stacked; tiled: concatenated)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a global array: replicate it on every device
    out = jax.jit(_identity, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
  else:
    local = np.asarray(x)
    local = local[None] if local.ndim == 0 or not tiled else local  # [1 or rows, ...] from this process
    if jax.process_count() == 1:
      return local
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()),
                             ("processes", "local_devices"))
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("processes")), local)
    out = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)  # [P * rows, ...]
  return np.asarray(settled(out).addressable_data(0))


def to_host(x):
  """A jax.Array as numpy on every process, also when its shards live on other processes."""
  import numpy as np
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return process_allgather(x, tiled=True)


def is_main_process() -> bool:
  """Process 0: the one that prints progress and writes logs, events and single files."""
  import jax
  return jax.process_index() == 0


class Silent:
  """Stands in for a logger (any method, any arguments) on processes other than 0."""

  def __getattr__(self, name):
    return lambda *args, **kwargs: None


# ---------------------------------------------------------------- exiting together


def run_main(main, argv) -> None:
  """Runs an entry point's main(argv), then ends the process at once with its code (0, a sys.exit's,
  1 on an exception), its output flushed. main has finished its own work by then (checkpoints
  written, writers closed, the server stopped); what the interpreter's normal exit would still do,
  joining threads and tearing the runtime down, can hold a process for minutes: on a TPU v5e
  train.py lived 60+ s past its closing line. With several processes a clean end first passes
  jax.distributed's shutdown barrier (so no process leaves while another still needs the
  coordinator); a failure skips it, which would hold the process for minutes waiting for peers that
  wait for it; the peers' next collective then fails (connection closed by peer), so they end too."""
  import jax
  code = 0
  try:
    main(argv)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if e.code is not None and not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
  except BaseException as e:  # noqa: BLE001 - every failure must end every process
    traceback.print_exc()
    if jax.distributed.is_initialized():
      print(f"error: process {jax.process_index()} of {jax.process_count()} failed ({type(e).__name__}: "
            f"{_first_line(e)}); ending it, and with it the others", file=sys.stderr)
    code = 1
  if not code and jax.distributed.is_initialized():
    jax.distributed.shutdown()
  logging.shutdown()  # what atexit would have flushed
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
