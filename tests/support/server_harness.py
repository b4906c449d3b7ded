"""What the server tests share: a stand-in for ServingEngine over the real Scheduler, and a bounded wait.
(The app served in a thread is MaxText.server.in_process.serve_in_thread.)"""

import contextlib
import time

from MaxText.inference.page_allocator import PageAllocator
from MaxText.inference.scheduler import Scheduler


class SchedulerEngine:
  """ServingEngine's interface (what EngineThread calls) over the real Scheduler and PageAllocator;
  a subclass says each scheduled row's next token in next_tokens(rows) (it may raise: a failed step)."""

  def __init__(self, *, num_pages: int, page_size: int, max_num_seqs: int, max_num_tokens: int, chunk: int,
               max_length: int, eos_id: int | None):
    self.max_seqs, self.warmed = max_num_seqs, False
    self.requests = []  # every request added, in order
    self._sizes = dict(num_pages=num_pages, page_size=page_size, max_num_tokens=max_num_tokens, chunk=chunk,
                       max_length=max_length, eos_id=eos_id)
    self.reset()

  def reset(self):
    s = self._sizes
    self.allocator = PageAllocator(s["num_pages"], s["page_size"], prefix_caching=False)
    self.scheduler = Scheduler(self.allocator, max_num_seqs=self.max_seqs, max_num_tokens=s["max_num_tokens"],
                               chunk=s["chunk"], max_length=s["max_length"], eos_id=s["eos_id"], vocab_size=512)

  def programs(self, first=False):
    return []

  def warmup(self, shapes=None):
    self.warmed = True
    return 0

  def add_request(self, prompt, params):
    self.requests.append(self.scheduler.add(prompt, params))
    return self.requests[-1]

  def abort(self, request):
    self.scheduler.abort(request)

  @property
  def idle(self):
    return self.scheduler.idle

  def next_tokens(self, rows) -> list[int]:
    raise NotImplementedError

  def step(self):
    rows = self.scheduler.schedule()
    made = [len(r.request.output) for r in rows]
    self.scheduler.update(rows, self.next_tokens(rows))
    return [(r.request, r.request.output[-1]) for r, n in zip(rows, made) if len(r.request.output) > n]

  def stats(self):
    return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "pages_used": self.allocator.used_pages, "pages_total": self._sizes["num_pages"]}


class ScriptedEngine(SchedulerEngine):
  """The server's unit-test engine: a step takes step_s seconds, samples token token_base + position,
  raises while `fail_next` is set, and schedules nothing while `paused` (requests stay waiting)."""

  def __init__(self, step_s: float = 0.005, token_base: int = 100):
    self.fail_next, self.paused, self.step_s, self.token_base = False, False, step_s, token_base
    super().__init__(num_pages=16, page_size=4, max_num_seqs=2, max_num_tokens=8, chunk=4, max_length=32, eos_id=None)

  def next_tokens(self, rows):
    if self.fail_next:
      self.fail_next = False
      raise RuntimeError("boom")
    return [self.token_base + r.start + r.count for r in rows]

  def step(self):
    time.sleep(self.step_s)  # a step takes time: commands arrive between steps
    return [] if self.paused else super().step()


def wait_for(predicate, what: str, timeout: float = 20.0, poll: float = 0.05):
  """Polls predicate() every `poll` seconds until it holds; fails the test naming `what` after `timeout`."""
  import pytest
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    time.sleep(poll)
  pytest.fail(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def scripted_server(config, step_s: float = 0.02):
  """(url, ScriptedEngine, Server): the real app, uvicorn and engine thread over a ScriptedEngine, token-id prompts
  (no tokenizer), model id "tiny", under `config`; served in a thread until the block ends."""
  from MaxText.server.app import Server, build_app
  from MaxText.server.engine_thread import EngineThread
  from MaxText.server.in_process import serve_in_thread
  from MaxText.server.protocol import Texts
  eng = ScriptedEngine(step_s=step_s)
  engine = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
  texts = Texts(None, add_bos=False, vocab_size=512, chat_template=None, chat_template_source="none",
                special_tokens={})
  server = Server(config, texts, engine, "tiny")
  with serve_in_thread(build_app(server)) as (url, _):
    wait_for(lambda: engine.ready, "the engine to start", timeout=10)
    yield url, eng, server
