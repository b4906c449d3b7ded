"""A checkpoint read that owns its asyncio tasks: none is left running when the read returns or fails.

orbax runs each read in an event loop of its own (`asyncio_utils.run_sync`: `asyncio.new_event_loop()`,
`run_until_complete`, `close()`), one task per array shard under an `asyncio.gather`. When one shard fails
(a truncated or garbled file), the gather raises at once and the loop is closed with the sibling reads still
in flight. They then report from wherever they end, long after the caller has moved on to the checkpoint
before: `Exception ignored in: <coroutine object _read_array_index_and_device_put>` when an abandoned
coroutine is garbage collected, `RuntimeError: Event loop is closed` when a TensorStore read completes into
the closed loop, `Task exception was never retrieved`. Whether and how much depends on timing (issue 46).

`owned()` scopes a read (a context manager and a decorator): an event loop that the entering thread creates
inside it cancels its pending tasks and waits for them, its async generators and its default executor's
threads before it closes, as `asyncio.run` does; and once closed it drops what other threads still hand it
(a cancelled TensorStore read completing late) instead of raising in those threads. Invariant: when a loop
created in the scope is closed, none of its tasks is running and nothing it started can report, so nothing
prints after the read's own error. Other threads' loops are left as they are (a server's loop, orbax's
background writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


def _finish_then_close(loop: asyncio.AbstractEventLoop, close) -> None:
  """Cancels loop's pending tasks and runs the loop until each has ended (a read cancelled mid-way ends
  with its error: orbax turns CancelledError into Exception; both are collected here, never reported),
  then shuts down its async generators and executor threads, then closes it."""
  try:
    if not loop.is_closed() and not loop.is_running():
      pending = asyncio.all_tasks(loop)
      for task in pending:
        task.cancel()
      if pending:  # gather() of nothing would look for a current loop (orbax has unset it)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      loop.run_until_complete(loop.shutdown_asyncgens())
      loop.run_until_complete(loop.shutdown_default_executor())
  finally:
    close()


def _dropped_once_closed(loop: asyncio.AbstractEventLoop, call_soon_threadsafe):
  """loop.call_soon_threadsafe, except that a call into the loop once it is closed is dropped, not raised.
  Such a call is a cancelled read completing late: TensorStore's thread settles the future its task awaited
  (the task has ended; nobody waits for the result), and the RuntimeError would print from that thread."""
  def call(callback, *args, **kwargs):
    try:
      return call_soon_threadsafe(callback, *args, **kwargs)
    except RuntimeError:
      if loop.is_closed():
        return None
      raise
  return call


_lock = threading.Lock()
_owners: dict[int, int] = {}  # thread id -> how many owned() scopes it is inside; guarded by _lock
_outer: list[asyncio.AbstractEventLoopPolicy] = []  # the policy around the scopes, while any is open


class _OwningPolicy(asyncio.AbstractEventLoopPolicy):
  """The policy around the scopes, except that an owner thread's new loops end their tasks before closing."""

  def __init__(self, inner: asyncio.AbstractEventLoopPolicy):
    self._inner = inner

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    loop = self._inner.new_event_loop()
    with _lock:
      mine = threading.get_ident() in _owners
    if mine:
      close, call_soon_threadsafe = loop.close, loop.call_soon_threadsafe
      loop.close = lambda: _finish_then_close(loop, close)
      loop.call_soon_threadsafe = _dropped_once_closed(loop, call_soon_threadsafe)
    return loop

  def get_event_loop(self):
    return self._inner.get_event_loop()

  def set_event_loop(self, loop) -> None:
    self._inner.set_event_loop(loop)

  def __getattr__(self, name):  # the rest (child watchers on Unix) as the policy around the scopes has them
    return getattr(self._inner, name)


@contextlib.contextmanager
def owned():
  """Inside: every event loop this thread creates ends its tasks before it closes (see the module). Nests, and
  several threads may be inside at once: the policy is installed by the first to enter, undone by the last out."""
  me = threading.get_ident()
  with _lock:
    if not _owners:
      _outer.append(asyncio.get_event_loop_policy())
      asyncio.set_event_loop_policy(_OwningPolicy(_outer[0]))
    _owners[me] = _owners.get(me, 0) + 1
  try:
    yield
  finally:
    with _lock:
      _owners[me] -= 1
      if not _owners[me]:
        del _owners[me]
      if not _owners:
        asyncio.set_event_loop_policy(_outer.pop())
