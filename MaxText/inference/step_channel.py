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
  spec_step  SpecStep.device_step(t, buf, mask, adjust): the same for the speculative (MTP) step
  reset      ServingEngine.reset(): empty pools (after a failed step or load)
  warmup     ServingEngine.warmup(shapes): those step programs compiled on padding (shapes: [n, 3] int32)
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

Lockstep (RL, MaxText/rl.py: every process runs the same Python program, the rollouts included): nothing is
replayed. Each process runs the engine's host logic itself (scheduler, allocator, prefix cache: pure functions
of the requests added and the tokens sampled, no clock, no id(), no process-local randomness in an RL request:
seeds are given) on the same prompts and seeds, and the sampled tokens are read by every process alike; so
the device calls are the same on every process by construction. Lockstep.send proves it instead of trusting
it: each process hashes the call's arguments (blake2b of the message encode() makes); process 0 writes its
digest as message i, and every other process compares its own before it makes call i. A difference (the
prompts files differ between hosts, a nondeterminism planted in the scheduler) is Diverged on that process,
raised before any divergent program is launched, one line, exit 1; process 0 sees it end (its connection)
and exits 1 too. Cost per call: one store write on process 0, one store read on the others (the RL step
keeps the processes together anyway: every engine step ends with a host read they all join).
`from_main(fn)`: fn runs on process 0 only and its numpy result reaches every process as the next message
(RL's rewards: user code, run once, so a reward that is not a pure function of the text cannot split the
processes). `close()` is a barrier: each process says it is done, process 0 waits for them all, so no
process reads another's normal exit as a loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
from typing import Callable

import numpy as np

from MaxText.runtime.cli import RunError

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

  def from_main(self, fn: Callable[[], object]):
    return fn()

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
    arr = np.asarray(a)  # a numpy array, or a fully addressable jax.Array (process 0's)
    blobs.append(arr.tobytes())  # C order whatever its strides (np.ascontiguousarray would make a 0-d array 1-d)
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

  program = "serve"  # the entry point named in a lost process's error line

  def __init__(self, client, process: int, processes: int, coordinator_host: str, timeout_s: float,
               on_lost: Callable[[str], None] | None = None):
    self.client, self.process, self.processes = client, process, processes
    self.main = process == 0
    self.seq = 0
    self.stopping = False  # after "stop": a closed connection is the normal shutdown
    self.failed = False  # process 0 lost a follower: no "stop" (the others see process 0 end, exit 1)
    self._timeout_ms = int(timeout_s * 1000)
    # process 0: its reaction to a lost follower (the server sets it); default exit 1
    self.on_lost = on_lost or (lambda why: lost(f"{self.program}: {why}"))
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
      lost(f"{self.program}: {why}")

  # ---- messages
  def send(self, op: str, *args) -> None:
    """Process 0, before making call `op` itself: every follower will make it with these arguments."""
    if not self.main:
      return
    self._write(encode(op, args))
    self.seq += 1
    if op == "stop":
      self.stopping = True

  def receive(self) -> tuple[str, tuple]:
    """A follower: the next message (waits as long as process 0 is idle; its connection says if it died)."""
    data = self._get(f"{PREFIX}/msg/{self.seq}")
    self.seq += 1
    op, args = decode(data)
    if op == "stop":
      self.stopping = True
    return op, args

  def _get(self, key: str) -> bytes:
    """A follower: the value of `key` once process 0 wrote it (waits as long as process 0 is busy or idle;
    its connection says if it died)."""
    while True:
      try:
        return self.client.blocking_key_value_get_bytes(key, _POLL_MS)
      except Exception as e:  # noqa: BLE001 - the store's timeout (DEADLINE_EXCEEDED): process 0 is idle
        if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
          raise

  def _write(self, data: bytes) -> None:
    """Process 0: message `seq` (the oldest kept one deleted: see WINDOW)."""
    self.client.key_value_set_bytes(f"{PREFIX}/msg/{self.seq}", data)
    if self.seq >= WINDOW:
      self.client.key_value_delete(f"{PREFIX}/msg/{self.seq - WINDOW}")

  def close(self) -> None:
    """Process 0: the followers return from follow(); then every connection closes."""
    if self.main and not self.stopping and not self.failed:
      self.send("stop")
    self.stopping = True


class Diverged(RunError):
  """A process's call differs from process 0's under Lockstep: one line, exit 1."""


class Lockstep(Channel):
  """Several processes that all run the host logic (RL): send() checks each call against process 0's,
  from_main() gives process 0's value to every process, close() is a barrier (the module docstring)."""
  program = "rl"

  def send(self, op: str, *args) -> None:
    """Every process, before making call `op`: raises Diverged unless process 0 makes it with the same args."""
    self._exchange(op, b"D" + hashlib.blake2b(encode(op, args), digest_size=16).digest())

  def from_main(self, fn: Callable[[], object]):
    """fn() on process 0 (a numpy array or a number); its value, bit for bit, on every process."""
    value = np.asarray(fn()) if self.main else None
    data = self._exchange("from_main", None if value is None else b"V" + encode("value", (value,)))
    return value if self.main else decode(data[1:])[1][0]

  def _exchange(self, op: str, mine: bytes | None) -> bytes:
    """Message `seq`: process 0 writes `mine`; another process reads process 0's and, when it has its own
    (a digest), compares. The first byte is the kind (D: a call's digest, V: a value), so two processes at
    different calls also differ."""
    if self.main:
      self._write(mine)
      theirs = mine
    else:
      theirs = self._get(f"{PREFIX}/msg/{self.seq}")
      if theirs[:1] != (mine or b"V")[:1] or (mine is not None and theirs != mine):
        raise Diverged(f"{self.program}: process {self.process}'s call {self.seq} ({op}) is not process 0's: the "
                       "processes' inputs differ (give every host the same data files, tokenizer and code)")
    self.seq += 1
    return theirs

  def close(self) -> None:
    """Every process at its normal end (not after an error: the others see it end and exit 1): each says it is
    done; process 0 waits for every other (timeout_s each) before any connection closes."""
    self.stopping = True
    if self.main:
      for p in range(1, self.processes):
        self.client.blocking_key_value_get(f"{PREFIX}/done/{p}", self._timeout_ms)
    else:
      self.client.key_value_set(f"{PREFIX}/done/{self.process}", "1")


def lost(why: str) -> None:
  """A follower whose process 0 is gone: nothing to serve; exit now (no shutdown barrier to wait in)."""
  print(f"error: {why}; exiting", file=sys.stderr, flush=True)
  os._exit(1)


def open_channel(timeout_s: float, on_lost: Callable[[str], None] | None = None, *,
                 lockstep: bool = False) -> Local | Channel:
  """LOCAL on one process; else the Channel joining every process (within timeout_s; on_lost: process 0's
  reaction to a follower's death, called from a watcher thread): a Lockstep one when every process runs the
  host logic (RL), else process 0 sends and the others follow (the server)."""
  import jax
  if jax.process_count() == 1:
    return LOCAL
  from jax._src import distributed  # the store jax.distributed.initialize started
  host = distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
  kind = Lockstep if lockstep else Channel
  return kind(distributed.global_state.client, jax.process_index(), jax.process_count(), host, timeout_s, on_lost)


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


__all__ = ["CALLS", "LOCAL", "Channel", "Diverged", "Local", "Lockstep", "decode", "encode", "follow", "lost",
           "open_channel"]
