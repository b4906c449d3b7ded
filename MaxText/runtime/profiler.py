"""profiler=xplane: a jax.profiler trace of profiler_steps steps from profiler_start_step, written
under <run>/profile (open it with `tensorboard --logdir <run>/profile` or the .trace.json.gz in
ui.perfetto.dev). Off by default; the first step is never the default (it compiles)."""

from __future__ import annotations

import jax

from MaxText.config.types import Config


class Profiler:

  def __init__(self, config: Config, start_step: int):
    self.on = config.profiler == "xplane"
    self.dir = config.profile_dir
    self.first = max(config.profiler_start_step, start_step + 1)
    self.last = min(self.first + config.profiler_steps - 1, config.steps)
    self.active = False

  def before_step(self, step: int) -> None:
    if self.on and step == self.first and self.first <= self.last:
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True

  def after_step(self, step: int) -> None:
    """Call once the step's results are on the host (the loop's metric fetch waits for the device)."""
    if self.active and step >= self.last:
      self.stop()
      print(f"profile of steps {self.first}-{self.last}: {self.dir} (tensorboard --logdir {self.dir}, or its "
            "*.trace.json.gz in ui.perfetto.dev)", flush=True)

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
