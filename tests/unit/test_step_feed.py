"""MaxText/inference/step_feed.py: a request's options travel in the step's one int32 array and come back
exactly inside the step (fp32 fields as their bits, never rounded to an integer; falsy values as themselves)."""

import types

import jax
import numpy as np
import pytest

from MaxText.inference import step_feed
from MaxText.inference.scheduler import SamplingParams


def _row(params):
  request = types.SimpleNamespace(params=params, tokens=[5, 6, 7], pages=[3], draft_row=0)
  return types.SimpleNamespace(request=request, count=1, known=1, start=2, drafts=[], samples=True)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9, top_k=3, min_p=0.05, seed=2 ** 40 + 2 ** 31 + 9),  # bit 31 set
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0),  # greedy, every filter off
    SamplingParams(temperature=1e-3, top_p=1e-3, min_p=1.0, lora_adapter=2)])
def test_each_option_comes_back_inside_the_step_exactly(params):
  feed = step_feed.empty(2, 4, 2)
  step_feed.fill(feed, [_row(params)], [1])
  f = jax.jit(step_feed.unpack, static_argnums=1)(step_feed.to_device(feed), 4)
  for name, want in (("temp", params.temperature), ("top_p", params.top_p), ("min_p", params.min_p)):
    assert f[name].dtype == np.float32 and float(f[name][1]) == np.float32(want), name
  assert int(f["top_k"][1]) == params.top_k and int(f["adapter"][1]) == params.lora_adapter
  assert int(f["seeds"][1]) == (params.seed or 0) % 2 ** 32 and bool(f["samples"][1])
  assert float(f["temp"][0]) == 0.0 and float(f["top_p"][0]) == 1.0 and not bool(f["samples"][0])  # padding
