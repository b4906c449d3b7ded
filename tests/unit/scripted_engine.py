"""A stand-in for the ServingEngine in the server's unit tests: its interface over the real Scheduler
and PageAllocator, with a scripted step (no model, nothing to compile)."""

import time

from MaxText.inference.page_allocator import PageAllocator
from MaxText.inference.scheduler import Scheduler


class ScriptedEngine:
  """ServingEngine's interface over the real Scheduler; step() samples token token_base + position, raises
  while `fail_next` is set, schedules nothing while `paused` (requests stay waiting)."""

  def __init__(self, step_s: float = 0.005, token_base: int = 100):
    self.max_seqs, self.fail_next, self.warmed, self.paused, self.step_s = 2, False, False, False, step_s
    self.token_base = token_base
    self.requests = []  # every request added, in order
    self.reset()

  def reset(self):
    self.allocator = PageAllocator(16, 4, prefix_caching=False)
    self.scheduler = Scheduler(self.allocator, max_num_seqs=2, max_num_tokens=8, chunk=4, max_length=32, eos_id=None,
                               vocab_size=512)

  def warmup(self):
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

  def step(self):
    time.sleep(self.step_s)  # a step takes time: commands arrive between steps
    if self.paused:
      return []
    rows = self.scheduler.schedule()
    if self.fail_next:
      self.fail_next = False
      raise RuntimeError("boom")
    made = [len(r.request.output) for r in rows]
    self.scheduler.update(rows, [self.token_base + r.start + r.count for r in rows])
    return [(r.request, r.request.output[-1]) for r, n in zip(rows, made) if len(r.request.output) > n]

  def stats(self):
    return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "pages_used": self.allocator.used_pages, "pages_total": 16}
