"""DeferredMetrics: step n's metrics come out when step n+1 is pushed, or at once by flush (what a
checkpoint step waits for); a pause between steps is not counted as step time."""

import time

import jax.numpy as jnp

from MaxText.runtime.metrics_prefetch import DeferredMetrics


def test_a_step_is_read_when_the_next_is_pushed_or_by_flush():
  d = DeferredMetrics()
  assert d.push(1, {"loss": jnp.float32(2.5)}, time.perf_counter()) == []
  (done,) = d.push(2, {"loss": jnp.float32(1.5)}, time.perf_counter())
  assert (done.step, done.scalars) == (1, {"loss": 2.5})
  (done,) = d.flush()
  assert (done.step, done.scalars) == (2, {"loss": 1.5})
  assert d.flush() == []


def test_a_pause_between_steps_is_not_step_time():
  d = DeferredMetrics()
  d.push(1, {"loss": jnp.float32(1)}, time.perf_counter())
  d.flush()
  time.sleep(0.3)  # e.g. a checkpoint save after step 1's metrics were read
  d.push(2, {"loss": jnp.float32(1)}, time.perf_counter())
  (done,) = d.flush()
  assert done.seconds < 0.2
