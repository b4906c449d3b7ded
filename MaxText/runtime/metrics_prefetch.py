"""A step's metrics read on the host one step late, so reading them never stalls the device queue.

`float(metric)` right after dispatching step n waits for step n to finish, and the device then
idles while the host prepares step n+1. Reading step n's metrics after step n+1 is dispatched
overlaps the two (MaxText does the same). Whatever must wait for step n's metrics (the NaN guard,
the decision to checkpoint step n's state) gets them from `flush` before it acts:

    deferred = DeferredMetrics()
    for step in steps:
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batch)       # step n dispatched, not waited for
      for done in deferred.push(step, metrics, t0):  # step n-1's metrics, read while step n runs
        report(done)                               # NaN guard, console, tensorboard
      if step is a checkpoint step:
        for done in deferred.flush():              # step n's own metrics first: only a good
          report(done)                             # state is saved (report raises otherwise)
        save(step, state)
    for done in deferred.flush():
      report(done)

A checkpoint step waits for its metrics before the next step is dispatched: the next step
donates the state's buffers, so step n's state cannot be kept around for a late decision
without a second copy of it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax


class StepMetrics(NamedTuple):
  step: int
  scalars: dict[str, float]
  # The step's wall time: from the later of its dispatch and the previous read to its read. In a
  # steady run that is read-to-read (one step of device time); a pause between steps (a checkpoint
  # save) is not counted; the first step includes its compilation.
  seconds: float


class DeferredMetrics:
  """Holds the newest step's device metrics until the next push (or a flush) reads them."""

  def __init__(self):
    self._pending: tuple[int, dict, float] | None = None
    self._last_read = 0.0

  def push(self, step: int, metrics: dict, dispatched_at: float) -> list[StepMetrics]:
    """Keeps step's metrics (jax arrays, still computing; the step was dispatched at time.perf_counter()
    = dispatched_at); returns the previous step's, read now."""
    ready = self.flush()
    self._pending = (step, metrics, dispatched_at)
    return ready

  def flush(self) -> list[StepMetrics]:
    """The pending step's metrics as floats (waits for that step), or [] if none is pending."""
    if self._pending is None:
      return []
    step, metrics, dispatched_at = self._pending
    self._pending = None
    scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    seconds, self._last_read = now - max(self._last_read, dispatched_at), now
    return [StepMetrics(step, scalars, seconds)]
