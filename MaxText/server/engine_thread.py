"""The engine in its own thread: the only thread that ever calls the ServingEngine.

    engine = EngineThread(make_engine, max_waiting=256)   # make_engine: a context manager yielding it
    engine.start()                                       # builds, compiles (warmup), then serves
    stream = await engine.submit(prompt_ids, sampling)   # ApiError 400 / 429 / 503 when refused
    async for token in stream: ...                       # tokens as the engine makes them
    stream.finish_reason                                 # "stop" | "length" | "abort"
    stream.logprobs, stream.prompt_logprobs              # asked for: one Logprob a token; the prompt's

A request that asks for logprobs gets each token's with its event, and its prompt's (one per prompt
token, the first None) with its first token's event.

The asyncio side talks to the thread through two thread-safe queues: an inbox (add, abort, stop)
the thread reads between steps, and one asyncio queue per request that the thread fills with
`loop.call_soon_threadsafe`. The thread drains the scheduler's finished list after every step
(nothing accumulates over a server's life) and publishes `stats` (the engine's stats()) for the
metrics. A step that raises fails the requests it ran (an error event each), resets the engine
and goes on: one bad request never ends the server. Over several processes (on_step_failure given) a
failed step means a lost process: on_step_failure(why) decides (the server fails every request and
exits); `fail` ends every open and queued request with an error from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
import traceback
from typing import Any, Callable, ContextManager

from MaxText.inference.scheduler import RequestError, SamplingParams
from MaxText.server.protocol import ApiError

_IDLE_WAIT_S = 0.05  # how long an idle engine waits for the inbox before looking again


@dataclasses.dataclass
class _Event:
  token: int | None = None
  logprob: Any = None  # the token's inference.logprobs.Logprob, when asked
  prompt_logprobs: list | None = None  # with the first token, when asked
  finish_reason: str | None = None
  error: ApiError | None = None


class RequestStream:
  """One request's tokens on the asyncio side; iterate it, then read finish_reason."""

  def __init__(self, loop: asyncio.AbstractEventLoop, prompt: list[int], params: SamplingParams):
    self.loop, self.prompt, self.params = loop, prompt, params
    self._queue: asyncio.Queue[_Event] = asyncio.Queue()
    self.finish_reason: str | None = None
    self.request = None  # the engine's Request (touched by the engine thread only)
    self.logprobs: list = []  # per token iterated: its Logprob (None when not asked)
    self.prompt_logprobs: list | None = None  # set before the first token is iterated, when asked

  def put(self, event: _Event) -> None:
    """From the engine thread."""
    self.loop.call_soon_threadsafe(self._queue.put_nowait, event)

  async def next_event(self) -> _Event:
    return await self._queue.get()

  def __aiter__(self):
    return self

  async def __anext__(self) -> int:
    if self.finish_reason is not None:
      raise StopAsyncIteration
    event = await self._queue.get()
    if event.error is not None:
      self.finish_reason = "error"
      raise event.error
    if event.prompt_logprobs is not None:
      self.prompt_logprobs = event.prompt_logprobs
    if event.finish_reason is not None:
      self.finish_reason = event.finish_reason
      raise StopAsyncIteration
    self.logprobs.append(event.logprob)
    return event.token


class EngineThread:
  def __init__(self, make_engine: Callable[[], ContextManager], *, max_waiting: int, log=print,
               on_step_failure: Callable[[str], None] | None = None, warmup: str = "all"):
    """make_engine(): a context manager that yields the ServingEngine (entered in the engine thread,
    so a mesh or sharding context it sets holds for every call). on_step_failure(why): called instead
    of resetting the engine when a step raises (several processes: the step's peers are not all there).
    warmup (serve_warmup): "all" compiles every step program before the engine is ready; "first" only
    engine.programs(first=True), the rest one at a time while the engine is idle, smallest first (a
    step that needs one not compiled yet compiles it then)."""
    self._make_engine, self.max_waiting, self.log = make_engine, max_waiting, log
    self._warmup = warmup
    self._pending: list = []  # step programs still to compile while idle (engine thread only)
    self._compiling = False  # the engine thread is compiling with no request to serve (stop need not wait)
    self._on_step_failure = on_step_failure
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self.state = "starting"  # starting -> compiling -> ready | failed; stopped at the end
    self.stats: dict = {}
    self.failure: str | None = None
    self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
    self._streams: dict = {}  # engine Request -> RequestStream (engine thread only)

  @property
  def ready(self) -> bool:
    return self.state == "ready"

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout: float = 30.0) -> None:
    """Aborts what still runs and ends the thread, waiting up to `timeout` s. While it only compiles (the
    warmup, or a step program while idle: no request to end) it is not waited for: it is a daemon, a compile
    cannot be cut short, and the process exits without it (distributed.run_main)."""
    if self._thread.is_alive():
      self._inbox.put(("stop",))
      deadline = time.monotonic() + timeout
      while self._thread.is_alive() and not self._compiling and time.monotonic() < deadline:
        self._thread.join(0.05)

  # ---- the asyncio side
  async def submit(self, prompt: list[int], params: SamplingParams) -> RequestStream:
    """Queues a request -> its stream once the engine accepted it; ApiError when refused."""
    if self.state == "failed":  # a failed build or warmup; a lost process (its failure says the server is exiting)
      raise ApiError(503, f"the engine failed ({self.failure}): this server takes no more requests", None,
                     "engine_failed")
    if self.state == "stopped":
      raise ApiError(503, "the server is shutting down: it takes no more requests", None, "shutting_down")
    if self.state != "ready":
      raise ApiError(503, f"the engine is not ready ({self.state}): retry when GET /health is 200", None,
                     "engine_not_ready")
    stream = RequestStream(asyncio.get_running_loop(), prompt, params)
    self._inbox.put(("add", stream))
    event = await stream.next_event()  # accepted (no token, no reason) or refused
    if event.error is not None:
      raise event.error
    return stream

  def abort(self, stream: RequestStream) -> None:
    """Ends a request now (its client went away); its pages are freed by the next engine loop."""
    if stream.finish_reason is None:
      self._inbox.put(("abort", stream))

  # ---- the engine thread
  def _main(self) -> None:
    try:
      with self._make_engine() as engine:
        self.state, self._compiling = "compiling", True
        t0 = time.perf_counter()
        every = engine.programs()
        n = engine.warmup(engine.programs(first=True) if self._warmup == "first" else every)
        self._compiling = False
        self._pending = every[n:]  # programs(first=True) is every's first n
        self.log(f"serve: compiled {n} step programs in {time.perf_counter() - t0:.1f} s; ready"
                 + (f" (the other {len(self._pending)} compile while idle, smallest first)" if self._pending else ""))
        self.stats = engine.stats()
        self.state = "ready"
        self._loop(engine)
    except BaseException as e:  # noqa: BLE001 - a failed build or warmup ends serving, reported by /health
      self.failure = f"{type(e).__name__}: {e}"
      self.log(f"serve: the engine failed: {self.failure}\n{traceback.format_exc()}")
      self.state = "failed"
      self._refuse_all(ApiError(503, f"the engine failed: {self.failure}", None, "engine_failed"))
      return
    if self.state != "failed":
      self.state = "stopped"

  def _loop(self, engine) -> None:
    ready = time.perf_counter()
    while True:
      if not self._read_inbox(engine, block=engine.idle and not self._pending):
        for stream in list(self._streams.values()):
          engine.abort(stream.request)
        self._finish(engine)
        return
      if not engine.idle:
        self._step(engine)
      elif self._pending:  # idle: the next step program (a request waits for one compile at most)
        self._compiling = True
        engine.warmup([self._pending.pop(0)])
        self._compiling = False
        if not self._pending:
          self.log(f"serve: every step program compiled, {time.perf_counter() - ready:.1f} s after ready")
      if self.state == "failed":  # fail(): a lost process; the server exits
        return
      self.stats = engine.stats()

  def _read_inbox(self, engine, block: bool) -> bool:
    """Handles every queued command (waiting a little for one when the engine is idle); False on stop."""
    try:
      cmd = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
    except queue.Empty:
      return True
    while True:
      kind, *args = cmd
      if kind == "stop":
        return False
      stream = args[0]
      if kind == "add":
        self._add(engine, stream)
      elif kind == "abort" and stream.request is not None:
        engine.abort(stream.request)
      try:
        cmd = self._inbox.get_nowait()
      except queue.Empty:
        return True

  def _add(self, engine, stream: RequestStream) -> None:
    sched = engine.scheduler
    queued = len(sched.waiting) - max(0, engine.max_seqs - len(sched.running))  # beyond the free sequence slots
    if queued >= self.max_waiting:
      stream.put(_Event(error=ApiError(429, f"{self.max_waiting} requests already wait (serve_max_waiting): "
                                       "retry later", None, "too_many_waiting")))
      return
    try:
      stream.request = engine.add_request(stream.prompt, stream.params)
    except RequestError as e:
      stream.put(_Event(error=ApiError.bad_field(e)))
      return
    except Exception as e:  # noqa: BLE001 - a bug in one request's admission fails that request only
      stream.put(_Event(error=ApiError(500, f"{type(e).__name__}: {e}")))
      return
    self._streams[stream.request] = stream
    stream.put(_Event())  # accepted

  def _step(self, engine) -> None:
    try:
      made = engine.step()
    except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
      if self._on_step_failure is not None:
        self._on_step_failure(f"an engine step failed ({type(e).__name__}: {str(e).strip()[:200]})")
        return
      self.log(f"serve: an engine step failed; its requests end with an error\n{traceback.format_exc()}")
      error = ApiError(500, f"the engine step failed: {type(e).__name__}: {e}")
      for stream in self._streams.values():
        stream.put(_Event(error=error))
      self._streams.clear()
      with contextlib.suppress(Exception):
        engine.reset()
      return
    for request, token in made:
      self._streams[request].put(self._token_event(request, token))
    self._finish(engine)

  @staticmethod
  def _token_event(request, token: int) -> _Event:
    """A token's event; with the logprobs its request asks for (the prompt's with its first token)."""
    p, pos = request.params, len(request.tokens) - 1  # the token just made is the sequence's last
    event = _Event(token=token, logprob=request.logprobs.get(pos) if p.logprobs is not None else None)
    if p.prompt_logprobs is not None and len(request.output) == 1:
      event.prompt_logprobs = _prompt_logprobs(request)
    return event

  def _finish(self, engine) -> None:
    """Empties the scheduler's finished list, then ends those requests' streams (in that order: a client
    that sees its end never sees its request still listed)."""
    for request in engine.scheduler.take_finished():
      stream = self._streams.pop(request, None)
      if stream is not None:  # a request that made no token (its first was a stop) gets its prompt's here
        unsent = request.params.prompt_logprobs is not None and not request.output
        stream.put(_Event(finish_reason=request.finish_reason, prompt_logprobs=_prompt_logprobs(request) if unsent
                          else None))

  def fail(self, error: ApiError) -> None:
    """From any thread: the engine is gone (state failed, /health 503); every open request and every queued
    one ends with `error` (an error event on a stream)."""
    self.failure, self.state = error.message, "failed"
    self._refuse_all(error)

  def _refuse_all(self, error: ApiError) -> None:
    for stream in list(self._streams.values()):
      stream.put(_Event(error=error))
    self._streams.clear()
    while True:
      try:
        cmd = self._inbox.get_nowait()
      except queue.Empty:
        return
      if cmd[0] == "add":
        cmd[1].put(_Event(error=error))


def _prompt_logprobs(request) -> list:
  """A request's prompt logprobs, one per prompt token (the first None: nothing predicts it)."""
  return [request.logprobs.get(i) if i else None for i in range(len(request.prompt))]
