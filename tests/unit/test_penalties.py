"""MaxText/inference/penalties.py against vLLM's definitions in float64 numpy: logit_bias, min_tokens,
repetition, frequency and presence penalties (any mix of rows, a row that adjusts nothing untouched), both
the whole-history twin (from_scratch) and the engine's incremental path (History + the device State) over
multi-step runs, and min_p as softmax(logits / T) >= min_p * max."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.inference import penalties
from MaxText.inference.scheduler import Request, SamplingParams

V, EOS = 40, 2


def _row(params, prompt, output, samples=True):
  return types.SimpleNamespace(request=Request(list(prompt), params, output=list(output)), samples=samples)


def _incremental(history, state, rows, logits, running=None):
  """The engine's path on one step of rows at batch rows 0.. -> (logits [B,V] after stages 1-3, the State).
  running: the scheduler's running requests (default: the rows')."""
  b = len(rows)
  running = [row.request for row in rows] if running is None else running
  adjust = history.step_arrays(rows, range(b), b, V, EOS, running)
  if adjust is None:
    return np.asarray(logits), state
  state, inputs = penalties.device_inputs(state, adjust, len(state[0]), V)
  return np.asarray(penalties.apply(jnp.asarray(logits)[:, None], *inputs)[:, 0]), state


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
  ids, vals = penalties.from_scratch(rows, [0, 1, 2, 3], 4, V, EOS)
  assert ids.shape[1] == 32  # the fullest row's 32 ids -> a power of two
  scratch = np.asarray(jax.jit(penalties.apply_entries)(logits, ids, vals))
  incremental, _ = _incremental(penalties.History(4), penalties.init_state(4, V), rows, logits)
  for got in (scratch, incremental):
    for i, row in enumerate(rows):
      r = row.request
      want = _vllm(logits[i], r.params, r.prompt, r.output)
      np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    assert np.isneginf(got[2, [EOS, 9]]).all()  # min_tokens 4 > 2 made: neither can end the output yet
    np.testing.assert_array_equal(got[1], logits[1])


def test_incremental_penalties_equal_the_whole_history_ones_over_a_multi_step_run():
  """Rows that join, sample for steps, leave (their slot reused by a later request) and come back (a preempted
  request: a fresh slot, its history sent again): each step the engine's path (History's new tokens only, the
  device State) equals from_scratch's rebuild and vLLM's float64 definitions, repetition over prompt + output,
  presence and frequency over the output only. Each step sends only the tokens a slot lacks."""
  rng = np.random.default_rng(3)
  kinds = [dict(repetition_penalty=1.4), dict(presence_penalty=1.5), dict(frequency_penalty=-0.7),
           dict(repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=-1.1, logit_bias=((3, 2.0),)),
           dict(min_tokens=3, presence_penalty=0.5), dict()]
  history, state = penalties.History(4), penalties.init_state(4, V)
  live = [Request(list(rng.integers(0, V, 24)), SamplingParams(max_tokens=64, **kinds[i])) for i in range(4)]
  joined = 4
  for step in range(40):
    if step % 9 == 8:  # one leaves, a new request takes its place (and its slot)
      live[step % 4] = Request(list(rng.integers(0, V, 5 + step)), SamplingParams(max_tokens=64, **kinds[joined % 6]))
      joined += 1
    rows = [types.SimpleNamespace(request=r, samples=True) for r in live]
    if step == 20:  # live[1:] preempted: a step runs live[0] alone, then they are back with their history
      _, state = _incremental(history, state, rows[:1], np.zeros((1, V), np.float32))
      assert set(history.slot) == {live[0]}
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    got, state = _incremental(history, state, rows, logits)
    scratch = penalties.from_scratch(rows, range(4), 4, V, EOS)
    want = logits if scratch is None else np.asarray(penalties.apply_entries(jnp.asarray(logits), *scratch))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    for i, r in enumerate(live):
      np.testing.assert_allclose(got[i], _vllm(logits[i], r.params, r.prompt, r.output), rtol=1e-6, atol=1e-5)
    for r in live:
      r.output.append(int(rng.integers(0, V)) if rng.random() < 0.6 else (r.output or r.prompt)[-1])  # repeats
  assert joined > 6 and 0 < sum(np.asarray(state[1]).ravel()) < 4 * 40


def test_a_step_sends_only_the_tokens_a_slot_lacks():
  """The prompt once (and the output so far), then one token a step: what travels is O(new tokens)."""
  r = Request(list(range(20)), SamplingParams(max_tokens=8, repetition_penalty=1.2), output=[5])
  history, row = penalties.History(2), types.SimpleNamespace(request=r, samples=True)
  _, pen = history.step_arrays([row], [0], 1, V, EOS, [r])
  assert pen[1].tolist() == [True] and pen[2].shape == (1, 32) and (pen[2][0, :21] == [*range(20), 5]).all()
  assert pen[3][0].tolist() == [False] * 20 + [True] + [False] * 11  # the prompt's only seen, the output counted
  r.output.append(7)
  _, pen = history.step_arrays([row], [0], 1, V, EOS, [r])
  assert pen[1].tolist() == [False] and pen[2].shape == (1, 8) and pen[2][0].tolist() == [7] + [V] * 7


def test_min_tokens_lets_the_stops_back_once_reached_and_keeps_eos_under_ignore_eos():
  params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(9,))
  assert penalties.row_entries(params, [1], [4, 5], EOS) == {}
  ignore = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
  assert EOS not in penalties.row_entries(ignore, [1], [], EOS)


def test_a_step_whose_rows_adjust_nothing_runs_without_the_stage():
  plain = _row(SamplingParams(max_tokens=8, temperature=1.0, top_p=0.5), [1, 2], [3])
  prefill = _row(SamplingParams(max_tokens=8, presence_penalty=1.0), [1, 2], [], samples=False)
  assert penalties.from_scratch([plain, prefill], [0, 1], 2, V, EOS) is None
  assert penalties.History(2).step_arrays([plain, prefill], [0, 1], 2, V, EOS, []) is None


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


def test_a_row_with_no_entries_this_step_is_padding_not_a_failed_step():
  """presence / frequency penalty alone before the first token, min_tokens alone once reached: the row adjusts
  but has nothing to adjust yet; alone the step runs without the stage, beside a row with entries it is padding."""
  alone = [_row(SamplingParams(max_tokens=8, presence_penalty=1.0), [1, 2], []),
           _row(SamplingParams(max_tokens=8, frequency_penalty=-0.5), [1, 2], []),
           _row(SamplingParams(max_tokens=8, min_tokens=1), [1, 2], [5])]
  assert penalties.from_scratch(alone, [0, 1, 2], 3, V, EOS) is None
  biased = _row(SamplingParams(max_tokens=8, logit_bias=((4, 2.0),)), [1], [])
  ids, vals = penalties.from_scratch([*alone, biased], [0, 1, 2, 3], 4, V, EOS)
  assert (np.asarray(ids[:3]) == V).all() and np.asarray(ids[3, 0]) == 4  # the three are padding rows
  logits = np.zeros((4, V), np.float32)
  got = np.asarray(penalties.apply_entries(jnp.asarray(logits), ids, vals))
  np.testing.assert_array_equal(got[:3], 0.0)
  got, _ = _incremental(penalties.History(4), penalties.init_state(4, V), [*alone, biased], logits)
  np.testing.assert_array_equal(got[:3], 0.0)
  assert got[3, 4] == 2.0


@pytest.mark.parametrize("field,value", [("logit_bias", ((3, 0.5),)), ("min_tokens", 1), ("repetition_penalty", 1.2),
                                         ("repetition_penalty", 0.5), ("frequency_penalty", 0.1),
                                         ("frequency_penalty", -0.1), ("presence_penalty", 0.1),
                                         ("presence_penalty", -0.1)])
def test_each_field_alone_adjusts_and_changes_its_row(field, value):
  """adjusts() is true for each stage-1-3 field on its own, and the row's logits change (repetition over the
  prompt, the penalties over an output that repeats id 3, min_tokens banning EOS)."""
  params = SamplingParams(max_tokens=8, **{field: value})
  assert penalties.adjusts(params)
  logits = np.full((1, V), 1.0, np.float32)
  rows = [_row(params, [3, 4], [] if field == "min_tokens" else [3, 3])]
  got = np.asarray(penalties.apply_entries(jnp.asarray(logits), *penalties.from_scratch(rows, [0], 1, V, EOS)))
  assert not np.array_equal(got, logits), field
  got, _ = _incremental(penalties.History(1), penalties.init_state(1, V), rows, logits)
  assert not np.array_equal(got, logits), field


def test_the_defaults_and_their_falsy_spellings_adjust_nothing():
  for params in (SamplingParams(), SamplingParams(logit_bias=(), min_tokens=0, repetition_penalty=1.0,
                                                  frequency_penalty=0.0, presence_penalty=-0.0)):
    assert not penalties.adjusts(params)
  assert penalties.row_entries(SamplingParams(max_tokens=8, logit_bias=((5, 0.0),)), [1], [], EOS) == {5: [0.0, 1.0, 0.0]}


def test_min_tokens_bans_eos_and_stop_token_ids_but_not_a_single_token_stop_string():
  """vLLM bans only EOS and stop_token_ids; a stop string (its one-token id in stop_string_ids) is merely looked
  for from min_tokens on (the scheduler's _stops)."""
  params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(9, 11), stop_string_ids=(11,))
  entries = penalties.row_entries(params, [1], [4], EOS)
  assert set(entries) == {EOS, 9} and all(np.isneginf(v[0]) for v in entries.values())
  from MaxText.inference.scheduler import _stops
  assert [_stops(params, 11, made, EOS) for made in range(5)] == [False, False, False, True, True]
  assert all(_stops(params, 9, made, EOS) for made in range(5))  # banned before, a stop whenever it comes
  assert _stops(params, EOS, 0, EOS) and not _stops(SamplingParams(ignore_eos=True), EOS, 0, EOS)


def test_min_p_keeps_the_argmax_and_its_ties_at_min_p_1_and_an_id_exactly_at_the_threshold():
  logits = np.log(np.array([[0.4, 0.4, 0.2, 0.0 + 1e-9] + [1e-9] * (V - 4)], np.float32))
  got = np.asarray(penalties.min_p_filter(logits, np.array([1.0], np.float32), np.array([1.0], np.float32)))
  assert np.isfinite(got[0]).tolist()[:3] == [True, True, False] and np.isfinite(got).sum() == 2
  half = np.log(np.array([[0.5, 0.25, 0.125] + [1e-9] * (V - 3)], np.float32))  # dyadic: 0.25 is exactly 0.5 * max
  got = np.asarray(penalties.min_p_filter(half, np.array([1.0], np.float32), np.array([0.5], np.float32)))
  assert np.isfinite(got[0]).tolist()[:3] == [True, True, False]
  far = np.zeros((1, V), np.float32)
  far[0, 1:] = -200.0  # e^-200 of the max: below any threshold a positive min_p sets
  got = np.asarray(penalties.min_p_filter(far, np.array([1.0], np.float32), np.array([0.0], np.float32)))
  assert np.isfinite(got).all()  # min_p 0 is off: nothing dropped, however unlikely


@pytest.mark.parametrize("field,good,bad", [
    ("repetition_penalty", (1e-6, 1.0, 100.0), (0.0, -1.0, 100.5)),
    ("presence_penalty", (-2.0, 0.0, 2.0), (-2.01, 2.01)),
    ("frequency_penalty", (-2.0, 0.0, 2.0), (-2.01, 2.01)),
    ("min_p", (0.0, 1.0), (-0.01, 1.01)),
    ("min_tokens", (0, 8), (-1, 9)),
    ("top_k", (0, 1, V), (-1,)),  # the server maps vLLM's -1 (off) to 0; the engine takes 0 = off only
    ("logit_bias", ((), ((0, -100.0),), ((V - 1, 100.0),)), (((0, -100.5),), ((V, 1.0),), ((-1, 1.0),)))])
def test_each_penalty_field_is_checked_at_its_boundaries(field, good, bad):
  """The scheduler's check: its range's ends are accepted, one step past them is a RequestError naming the field
  (repetition_penalty 0 would divide the logits by zero: +inf)."""
  from MaxText.inference.scheduler import RequestError
  for v in good:
    SamplingParams(max_tokens=8, **{field: v}).check(V)
  for v in bad:
    with pytest.raises(RequestError) as e:
      SamplingParams(max_tokens=8, **{field: v}).check(V)
    assert e.value.field == field, v


def test_each_verified_position_sees_the_drafts_before_it_as_output():
  """Speculative verification: apply at T = 1 + k positions with drafts equals, at position j, from_scratch's
  logits for the row whose output has drafts[:j] appended (its penalties and its min_tokens count made + j);
  a row's drafts past its own (V) change nothing."""
  rng = np.random.default_rng(5)
  k = 3
  params = [SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=-0.4),
            SamplingParams(max_tokens=16, min_tokens=4, stop_token_ids=(9,), logit_bias=((9, 5.0), (3, -2.0)),
                           presence_penalty=0.8),
            SamplingParams(max_tokens=16, frequency_penalty=-1.0)]
  rows = [_row(p, rng.integers(0, V, 12), rng.integers(0, V, 2)) for p in params]
  drafts = np.array([[4, 4, 7], [9, 3, 9], [6, V, V]], np.int32)  # row 2: one draft
  logits = rng.normal(size=(3, k + 1, V)).astype(np.float32) * 3
  adjust = penalties.History(3).step_arrays(rows, range(3), 3, V, EOS, [row.request for row in rows])
  _, inputs = penalties.device_inputs(None, adjust, 3, V)
  got = np.asarray(penalties.apply(jnp.asarray(logits), *inputs, drafts=jnp.asarray(drafts)))
  for j in range(k + 1):
    ahead = [_row(p, row.request.prompt, row.request.output + [d for d in drafts[i, :j] if d < V])
             for i, (p, row) in enumerate(zip(params, rows))]
    want = np.asarray(penalties.apply_entries(jnp.asarray(logits[:, j]), *penalties.from_scratch(ahead, range(3), 3,
                                                                                                 V, EOS)))
    np.testing.assert_allclose(got[:, j], want, rtol=1e-6, atol=1e-5, err_msg=f"position {j}")
  assert np.isneginf(got[1, :2, 9]).all() and np.isfinite(got[1, 2:, 9]).all()  # made 2: banned at j < 2
