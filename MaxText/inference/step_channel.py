"""Process 0's device calls, replayed by every other process: the one place multi-process serving talks.

    channel = step_channel.open_channel(timeout_s)   # LOCAL on one process: send() does nothing
    engine.channel = channel                          # process 0: its engine announces each device call
    step_channel.follow(engine, channel)              # every other process: replays them until "stop"

Multi-host serving keeps ONE engine program over every process's devices (JAX's multi-controller runtime:
a jitted call over a global mesh must be made by every process, with the same inputs). Process 0 alone
owns the scheduler, the page allocator, the prefix cache, grammars, penalties, seeds and the HTTP side;
the other processes hold their shards of the parameters and pools and run no host logic at all. The seam is
the ServingEngine's device calls (CALLS: each a method every process runs with the same arguments):
  step       ServingEngine.device_step(t, buf, with_logprobs, with_rollout, mask, adjust): the step and write
             programs on the step feed (one int32 array [b, W]: rows, tokens, positions, page tables, sampling
             options and seeds; a per-row adapter id when it carries one), the grammar bitmask [b, ceil(V/32)]
             and the penalties' (ids, values), then the host reads of the outputs (collective on a mesh
             whose rows span processes)
  spec_step  SpecStep.device_step(t, buf, mask): the same for the speculative (MTP) step
  reset      ServingEngine.reset(): empty pools (after a failed step or load)
  warmup     ServingEngine.warmup(): every step program compiled on padding
  stop       the followers return (process 0 is shutting down)
Page frees, prefix-cache hits and aborts touch no device state (pages are reference counts on process
0): they reach the other processes only as the next step's page tables.

Protocol (the distributed key-value store of jax.distributed, not a collective: an idle server costs
nothing, and a follower waits on a key, never inside a collective program):
  - process 0 writes message i under key `maxtext_serve/msg/<i>` (i = 0, 1, ...) BEFORE it makes call i
    itself; a message is a JSON header (the call's name; each argument: None, a bool/int/float, a numpy
    array's dtype and shape, or a tuple of these) then the arrays' raw bytes.
  - a follower reads message i, i + 1, ... in order and makes the same call with the decoded arguments;
    so every process issues the same programs in the same order (the invariant a multi-controller
    runtime needs), and the inputs of call i are process 0's, bit for bit.
  - a follower lags process 0 by at most one step: each step ends with a host read every process joins
    (distributed.to_host of a global array), so process 0 deletes message i - WINDOW when it writes i.
  - One process (process_count() == 1): LOCAL, send() returns at once: nothing is encoded or written.
Measured on this CPU (2 processes on localhost, a 16 KiB message): a key-value write 0.58 ms, a write
plus the follower's read and answer 1.0 ms; jax.experimental.multihost_utils.broadcast_one_to_all of the
same array 3.2 ms (and a follower idle in a collective would hit gloo's timeout).

Failures (bounded, never a hang in a collective): besides the store, each follower holds one TCP
connection to process 0 (a port process 0 publishes in the store). Its end is seen at once by the
other side, whatever the cause (SIGKILL included): process 0 calls `on_lost` (the server fails every
open request and exits non-zero), a follower exits with code 1 (`lost`). After "stop" the ends are the
normal shutdown and are ignored. A process that hangs without dying is ended by JAX's coordination
service (heartbeat_timeout_seconds, 100 s by default), which terminates every process.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Callable

import numpy as np

PREFIX = "maxtext_serve"
WINDOW = 64  # messages kept in the store behind the newest (a follower is at most one step behind)
CALLS = {"step": "device_step", "reset": "reset", "warmup": "warmup"}  # the engine's methods; spec_step: SpecStep's
_POLL_MS = 1000  # a follower's wait for the next message, between checks that it is still wanted


class Local:
  """One process: nothing to tell anyone."""
  main = True
  multi = False

  def send(self, op: str, *args) -> None:
    pass

  def close(self) -> None:
    pass


LOCAL = Local()


def encode(op: str, args: tuple) -> bytes:
  """(op, args) -> bytes: a JSON header (length-prefixed) then the arrays' raw bytes, in order."""
  blobs: list[bytes] = []

  def spec(a):
    if a is None or isinstance(a, (bool, int, float, str)):
      return {"v": a}
    if isinstance(a, (tuple, list)):
      return {"items": [spec(x) for x in a]}
    arr = np.ascontiguousarray(np.asarray(a))  # a numpy array, or a fully addressable jax.Array (process 0's)
    blobs.append(arr.tobytes())
    return {"dtype": arr.dtype.str, "shape": list(arr.shape)}

  header = json.dumps({"op": op, "args": [spec(a) for a in args]}).encode()
  return len(header).to_bytes(8, "little") + header + b"".join(blobs)


def decode(data: bytes) -> tuple[str, tuple]:
  """encode's inverse -> (op, args) with numpy arrays (tuples stay tuples)."""
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + n])
  offset = 8 + n

  def value(s):
    nonlocal offset
    if "v" in s:
      return s["v"]
    if "items" in s:
      return tuple(value(x) for x in s["items"])
    dtype, shape = np.dtype(s["dtype"]), tuple(s["shape"])
    size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(data, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape).copy()
    offset += size
    return arr

  return header["op"], tuple(value(s) for s in header["args"])


class Channel:
  """Several processes: process 0 sends, the others receive (see the module docstring)."""
  multi = True

  def __init__(self, client, process: int, processes: int, coordinator_host: str, timeout_s: float,
               on_lost: Callable[[str], None] | None = None):
    self.client, self.process, self.processes = client, process, processes
    self.main = process == 0
    self.seq = 0
    self.stopping = False  # after "stop": a closed connection is the normal shutdown
    self.failed = False  # process 0 lost a follower: no "stop" (the others see process 0 end, exit 1)
    self._timeout_ms = int(timeout_s * 1000)
    self.on_lost = on_lost or lost  # process 0: its reaction to a lost follower (the server sets it); default exit 1
    self._conns: list[socket.socket] = []
    if self.main:
      self._listen(timeout_s)
    else:
      self._connect(coordinator_host)

  # ---- liveness: one TCP connection per follower
  def _listen(self, timeout_s: float) -> None:
    srv = socket.create_server(("", 0))
    client = self.client
    client.key_value_set(f"{PREFIX}/port", str(srv.getsockname()[1]))
    srv.settimeout(timeout_s)
    with srv:
      for _ in range(self.processes - 1):
        conn, _ = srv.accept()  # socket.timeout past timeout_s: a follower never came (raised to the caller)
        conn.settimeout(timeout_s)
        pid = int(conn.recv(16).decode())
        conn.settimeout(None)
        self._conns.append(conn)
        threading.Thread(target=self._watch, args=(conn, f"process {pid}"), daemon=True).start()

  def _connect(self, host: str) -> None:
    port = int(self.client.blocking_key_value_get(f"{PREFIX}/port", self._timeout_ms))
    conn = socket.create_connection((host, port), timeout=self._timeout_ms / 1000)
    conn.sendall(str(self.process).encode().ljust(16))
    conn.settimeout(None)
    self._conns.append(conn)
    threading.Thread(target=self._watch, args=(conn, "process 0"), daemon=True).start()

  def _watch(self, conn: socket.socket, who: str) -> None:
    try:
      while conn.recv(1):
        pass
    except OSError:
      pass
    if self.stopping:
      return
    why = f"{who} of {self.processes} is gone (its connection closed: it died or was killed)"
    if self.main:
      self.failed = True
      self.on_lost(why)
    else:
      lost(why)

  # ---- messages
  def send(self, op: str, *args) -> None:
    """Process 0, before making call `op` itself: every follower will make it with these arguments."""
    if not self.main:
      return
    self.client.key_value_set_bytes(f"{PREFIX}/msg/{self.seq}", encode(op, args))
    if self.seq >= WINDOW:
      self.client.key_value_delete(f"{PREFIX}/msg/{self.seq - WINDOW}")
    self.seq += 1
    if op == "stop":
      self.stopping = True

  def receive(self) -> tuple[str, tuple]:
    """A follower: the next message (waits as long as process 0 is idle; its connection says if it died)."""
    key = f"{PREFIX}/msg/{self.seq}"
    while True:
      try:
        data = self.client.blocking_key_value_get_bytes(key, _POLL_MS)
        break
      except Exception as e:  # noqa: BLE001 - the store's timeout (DEADLINE_EXCEEDED): process 0 is idle
        if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
          raise
    self.seq += 1
    op, args = decode(data)
    if op == "stop":
      self.stopping = True
    return op, args

  def close(self) -> None:
    """Process 0: the followers return from follow(); then every connection closes."""
    if self.main and not self.stopping and not self.failed:
      self.send("stop")
    self.stopping = True


def lost(why: str) -> None:
  """A follower whose process 0 is gone: nothing to serve; exit now (no shutdown barrier to wait in)."""
  print(f"error: serve: {why}; exiting", file=sys.stderr, flush=True)
  os._exit(1)


def open_channel(timeout_s: float, on_lost: Callable[[str], None] | None = None) -> Local | Channel:
  """LOCAL on one process; else the Channel joining every process (within timeout_s; on_lost: process 0's
  reaction to a follower's death, called from a watcher thread)."""
  import jax
  if jax.process_count() == 1:
    return LOCAL
  from jax._src import distributed  # the store jax.distributed.initialize started
  host = distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
  return Channel(distributed.global_state.client, jax.process_index(), jax.process_count(), host, timeout_s,
                 on_lost)


def follow(engine, channel: Channel) -> int:
  """A follower's life: replays process 0's calls on `engine` until "stop" -> how many it made."""
  made = 0
  while True:
    op, args = channel.receive()
    if op == "stop":
      return made
    if op == "spec_step":
      engine.spec.device_step(*args)
    else:
      getattr(engine, CALLS[op])(*args)
    made += 1


__all__ = ["CALLS", "LOCAL", "Channel", "Local", "decode", "encode", "follow", "lost", "open_channel"]
