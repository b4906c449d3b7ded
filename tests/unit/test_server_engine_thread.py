"""The engine thread (MaxText/server/engine_thread.py) over the real scheduler with a scripted step:
tokens reach each request's stream in order, a refused request is a 400 naming the field, a step
that raises fails only the requests it ran and the next request is served, the scheduler's finished
list is drained, and stop() aborts what still runs."""

import asyncio
import contextlib
import time

import pytest

from MaxText.inference.scheduler import SamplingParams
from MaxText.server.engine_thread import EngineThread
from MaxText.server.protocol import ApiError
from tests.support.server_harness import ScriptedEngine, wait_for


@pytest.fixture
def thread():
  eng = ScriptedEngine()
  t = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
  t.start()
  for _ in range(200):
    if t.ready:
      break
    time.sleep(0.01)
  assert t.ready and eng.warmed
  yield t, eng
  t.stop(10)
  assert t.state == "stopped"


async def _tokens(t, prompt, n):
  stream = await t.submit(prompt, SamplingParams(max_tokens=n))
  return [tok async for tok in stream], stream.finish_reason


def test_tokens_come_in_order_and_the_finished_list_is_drained(thread):
  t, eng = thread

  async def both():
    return await asyncio.wait_for(asyncio.gather(_tokens(t, [1, 2, 3], 4), _tokens(t, [5, 6], 3)), 10)

  (a, ra), (b, rb) = asyncio.run(both())
  assert a == [103, 104, 105, 106] and b == [102, 103, 104] and ra == rb == "length"
  assert eng.scheduler.finished == [] and eng.allocator.used_pages == 0


def test_a_refused_request_names_its_field_and_a_failing_step_fails_only_its_requests(thread):
  t, eng = thread
  with pytest.raises(ApiError) as e:
    asyncio.run(asyncio.wait_for(_tokens(t, [1, 2, 3], 40), 10))  # past max_length 32
  assert e.value.status == 400 and e.value.param == "max_tokens"
  eng.fail_next = True
  with pytest.raises(ApiError) as e:
    asyncio.run(asyncio.wait_for(_tokens(t, [1, 2], 3), 10))
  assert e.value.status == 500 and "boom" in e.value.message
  assert asyncio.run(asyncio.wait_for(_tokens(t, [1, 2], 2), 10)) == ([102, 103], "length")  # still serving


def test_stop_aborts_what_still_runs():
  eng = ScriptedEngine()
  t = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)

  async def run():
    t.start()
    for _ in range(200):
      if t.ready:
        break
      await asyncio.sleep(0.01)
    stream = await t.submit([1, 2], SamplingParams(max_tokens=25))
    await stream.__anext__()
    await asyncio.to_thread(t.stop, 10)
    rest = [tok async for tok in stream]
    return len(rest), stream.finish_reason

  n, reason = asyncio.run(asyncio.wait_for(run(), 20))
  assert reason == "abort" and n < 24 and eng.allocator.used_pages == 0


def test_exactly_serve_max_waiting_requests_wait_beyond_the_free_slots_and_the_next_is_a_429(thread):
  t, eng = thread  # max_waiting 4, 2 sequence slots
  eng.paused = True

  async def fill():
    streams = [await t.submit([1, 2], SamplingParams(max_tokens=2)) for _ in range(2 + 4)]  # slots + waiting
    assert len(eng.scheduler.waiting) == 6 and not eng.scheduler.running
    with pytest.raises(ApiError) as e:
      await t.submit([1, 2], SamplingParams(max_tokens=2))
    eng.paused = False
    return e.value, [[tok async for tok in s] for s in streams]

  refused, outs = asyncio.run(asyncio.wait_for(fill(), 10))
  assert refused.status == 429 and refused.code == "too_many_waiting" and "serve_max_waiting" in refused.message
  assert outs == [[102, 103]] * 6 and eng.allocator.used_pages == 0  # the accepted ones all run


def test_over_several_processes_a_failing_step_is_a_lost_process_every_request_errors_and_the_engine_ends():
  """on_step_failure (serve.py's, several processes) replaces reset-and-go-on: it calls fail(), every open
  request gets its 503, new ones are refused, and the engine loop ends in state failed."""
  eng = ScriptedEngine()
  eng.paused = True  # requests stay waiting until the step that fails
  why = []

  def lost(reason):
    why.append(reason)
    t.fail(ApiError(503, f"lost: {reason}", None, "engine_failed"))

  t = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None, on_step_failure=lost)
  t.start()
  for _ in range(200):
    if t.ready:
      break
    time.sleep(0.01)

  async def two():
    streams = [await t.submit([1, 2], SamplingParams(max_tokens=3)) for _ in range(2)]
    eng.fail_next, eng.paused = True, False
    out = []
    for s in streams:
      with pytest.raises(ApiError) as e:
        async for _ in s:
          pass
      out.append(e.value)
    return out

  errors = asyncio.run(asyncio.wait_for(two(), 10))
  assert [e.status for e in errors] == [503, 503] and "boom" in errors[0].message and len(why) == 1
  t._thread.join(5)
  assert not t._thread.is_alive() and t.state == "failed"
  with pytest.raises(ApiError) as e:
    asyncio.run(t.submit([1], SamplingParams(max_tokens=1)))
  assert e.value.status == 503


class _Compiling(ScriptedEngine):
  """programs() and warmup(shapes) as ServingEngine has them: each compile takes compile_s."""
  PROGRAMS = [(1, 1, 16), (1, 16, 16), (2, 1, 16), (2, 16, 16), (1, 1, 32), (1, 16, 32)]

  def __init__(self, compile_s=0.2):
    super().__init__()
    self.compile_s, self.compiled = compile_s, []

  def programs(self, first=False):
    return self.PROGRAMS[:2] if first else list(self.PROGRAMS)

  def warmup(self, shapes=None):
    for s in self.PROGRAMS if shapes is None else shapes:
      time.sleep(self.compile_s)
      self.compiled.append(tuple(s))
    return len(self.PROGRAMS if shapes is None else shapes)


@pytest.mark.parametrize("warmup", ["first", "all"])
def test_ready_after_the_first_programs_the_rest_compile_while_idle_smallest_first(warmup):
  eng = _Compiling()
  lines = []
  t = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lines.append, warmup=warmup)
  t.start()
  try:
    wait_for(lambda: t.ready, "ready")
    at_ready = list(eng.compiled)
    assert at_ready == (_Compiling.PROGRAMS[:2] if warmup == "first" else _Compiling.PROGRAMS)
    # a request sent now is served between two compiles, not after them all
    assert asyncio.run(asyncio.wait_for(_tokens(t, [1, 2], 2), 10)) == ([102, 103], "length")
    assert len(eng.compiled) < len(_Compiling.PROGRAMS) or warmup == "all"  # 4 x 0.2 s still to compile
    wait_for(lambda: len(eng.compiled) == len(_Compiling.PROGRAMS), "every program")
    assert eng.compiled == _Compiling.PROGRAMS  # each once, smallest first
    assert ("the other 4 compile while idle" in lines[0]) == (warmup == "first")
    assert any("every step program compiled" in line for line in lines) == (warmup == "first")
  finally:
    t.stop(10)
  assert t.state == "stopped"


def test_stop_does_not_wait_for_a_compile_with_no_request_to_end():
  """SIGTERM while the engine compiles an idle step program: the server exits now (the CPU's chat server waited
  15 s for its compiles), not after it; the thread is a daemon."""
  eng = _Compiling(compile_s=1.0)
  t = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None, warmup="first")
  t.start()
  wait_for(lambda: len(eng.compiled) == 3, "the first idle compile to finish")
  t0 = time.monotonic()
  t.stop(10)
  assert time.monotonic() - t0 < 0.5 and len(eng.compiled) == 3


def test_a_request_after_the_engine_failed_or_stopped_is_told_so_not_to_retry_when_ready(thread):
  """After a lost process (fail(): the server exits) a new request hears that the server is shutting down, not
  "not ready: retry when GET /health is 200"; after stop() likewise."""
  t, _ = thread
  t.fail(ApiError(503, "the server lost one of its processes (peer gone): it is shutting down", None, "engine_failed"))
  with pytest.raises(ApiError) as e:
    asyncio.run(asyncio.wait_for(_tokens(t, [1, 2], 2), 10))
  assert e.value.status == 503 and e.value.code == "engine_failed", e.value.message
  assert "shutting down" in e.value.message and "retry" not in e.value.message
  t.state = "stopped"
  with pytest.raises(ApiError) as e:
    asyncio.run(asyncio.wait_for(_tokens(t, [1, 2], 2), 10))
  assert e.value.code == "shutting_down" and "shutting down" in e.value.message
