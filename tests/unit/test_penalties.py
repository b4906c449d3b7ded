"""MaxText/inference/penalties.py against vLLM's definitions in float64 numpy: logit_bias, min_tokens,
repetition, frequency and presence penalties as one step's [B,S] arrays (any mix of rows, a row that
adjusts nothing untouched), and min_p as softmax(logits / T) >= min_p * max."""

import types

import jax
import numpy as np

from MaxText.inference import penalties
from MaxText.inference.scheduler import SamplingParams

V, EOS = 40, 2


def _row(params, prompt, output, samples=True):
  return types.SimpleNamespace(request=types.SimpleNamespace(params=params, prompt=prompt, output=output),
                               samples=samples)


def _vllm(logits, params, prompt, output):
  """vLLM's order on one row in float64: bias and min_tokens, repetition, frequency and presence."""
  lg = logits.astype(np.float64).copy()
  for tok, b in params.logit_bias:
    lg[tok] += b
  if len(output) < params.min_tokens:
    lg[list(params.stop_token_ids) + ([] if params.ignore_eos else [EOS])] = -np.inf
  seen = np.zeros(V, bool)
  seen[list(prompt) + list(output)] = True
  r = params.repetition_penalty
  lg = np.where(seen, np.where(lg > 0, lg / r, lg * r), lg)
  counts = np.bincount(np.asarray(output, int), minlength=V)
  return lg - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def test_bias_and_penalties_equal_vllms_definitions_row_by_row():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, V)).astype(np.float32) * 3  # both signs: the repetition penalty's two cases
  rows = [
    _row(SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.7,
                        logit_bias=((5, 4.0), (7, -100.0))), [1, 5, 9, 9], [3, 3, 3, 11, 5]),
    _row(SamplingParams(max_tokens=8), [1, 4], [6, 6]),  # adjusts nothing: its logits untouched
    _row(SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=(9,), presence_penalty=1.0), [1], [3, 3]),
    _row(SamplingParams(max_tokens=8, repetition_penalty=0.8, frequency_penalty=2.0), list(range(30)), [30, 31, 30]),
  ]
  ids, vals = penalties.step_arrays(rows, [0, 1, 2, 3], 4, V, EOS)
  assert ids.shape[1] == 32  # the fullest row's 32 ids -> a power of two
  got = np.asarray(jax.jit(penalties.apply)(logits, ids, vals))
  for i, row in enumerate(rows):
    r = row.request
    want = _vllm(logits[i], r.params, r.prompt, r.output)
    np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
  assert np.isneginf(got[2, [EOS, 9]]).all()  # min_tokens 4 > 2 made: neither can end the output yet
  np.testing.assert_array_equal(got[1], logits[1])


def test_min_tokens_lets_the_stops_back_once_reached_and_keeps_eos_under_ignore_eos():
  params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(9,))
  assert penalties.row_entries(params, [1], [4, 5], EOS) == {}
  ignore = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
  assert EOS not in penalties.row_entries(ignore, [1], [], EOS)


def test_a_step_whose_rows_adjust_nothing_runs_without_the_stage():
  plain = _row(SamplingParams(max_tokens=8, temperature=1.0, top_p=0.5), [1, 2], [3])
  prefill = _row(SamplingParams(max_tokens=8, presence_penalty=1.0), [1, 2], [], samples=False)
  assert penalties.step_arrays([plain, prefill], [0, 1], 2, V, EOS) is None


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely_after_temperature():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, V)).astype(np.float32) * 2
  temp, min_p = np.array([0.7, 0.0, 1.5], np.float32), np.array([0.1, 0.5, 0.0], np.float32)
  got = np.asarray(jax.jit(penalties.min_p_filter)(logits, temp, min_p))
  p = np.exp((logits[0] - logits[0].max()) / 0.7)  # float64 softmax up to its sum
  want = p >= 0.1 * p.max()
  assert 1 < want.sum() < V
  np.testing.assert_array_equal(np.isfinite(got[0]), want)
  np.testing.assert_array_equal(got[0][want], logits[0][want])
  np.testing.assert_array_equal(got[1:], logits[1:])  # greedy, and min_p 0: unchanged
