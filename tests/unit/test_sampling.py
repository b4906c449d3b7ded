"""MaxText/inference/sampling.py: per-row sampling (sample_rows) draws from the distribution
row_probs states, a row's draw never depends on the other rows (whichever lax.cond branch the
batch takes: all greedy, no filtering row, some filtering row), greedy is the argmax."""

import jax
import numpy as np

from MaxText.inference.sampling import greedy_ids, row_probs, sample_rows

sample = jax.jit(sample_rows)

V = 12
# greedy | unfiltered temp 0.7 | top_k 3 | top_p 0.5 (temp 1.3)
TEMP = np.array([0.0, 0.7, 1.0, 1.3], np.float32)
TOP_P = np.array([1.0, 1.0, 1.0, 0.5], np.float32)
TOP_K = np.array([0, 0, 3, 0], np.int32)


def _logits():
  return jax.random.normal(jax.random.key(0), (4, V)) * 2.0  # [4,V]


def test_each_row_draws_the_same_alone_as_in_any_batch():
  logits = _logits()
  for s in range(20):
    keys = jax.random.split(jax.random.key(s), 4)  # [4]
    batch = np.asarray(sample(logits, keys, TEMP, TOP_P, TOP_K))
    for i in range(4):  # alone: a batch of one takes another lax.cond branch (all greedy / none filtering)
      one = sample(logits[i:i + 1], keys[i:i + 1], TEMP[i:i + 1], TOP_P[i:i + 1], TOP_K[i:i + 1])
      assert int(one[0]) == batch[i], (s, i)
  assert (np.asarray(sample(logits, keys, 0 * TEMP, TOP_P, TOP_K)) == np.argmax(logits, -1)).all()


def test_draw_frequencies_follow_row_probs():
  logits, n = _logits(), 20000
  p = np.asarray(row_probs(logits[:, None], TEMP, TOP_P, TOP_K))[:, 0]  # [4,V]
  assert p[0].argmax() == np.argmax(logits[0]) and p[0].max() == 1.0  # greedy: one-hot
  assert (p[2] > 0).sum() == 3 and abs(p[3][p[3] > 0].sum() - 1) < 1e-5
  assert np.allclose(p[1], jax.nn.softmax(logits[1] / 0.7), atol=1e-6)
  draws = jax.jit(jax.vmap(lambda key: sample_rows(logits, jax.random.split(key, 4), TEMP, TOP_P, TOP_K)))(
      jax.random.split(jax.random.key(7), n))  # [n,4]
  freq = np.stack([np.bincount(np.asarray(draws[:, i]), minlength=V) / n for i in range(4)])  # [4,V]
  assert np.abs(freq - p).max() < 0.015, np.abs(freq - p).max()
  assert (freq[p == 0] == 0).all()  # nothing outside a row's top_k / top_p set


def test_greedy_ids_are_argmax_with_ties_lowest_first():
  x = jax.random.randint(jax.random.key(3), (64, 3, 9), 0, 4).astype(np.float32)  # many ties
  x = x.at[0, 0].set(-np.inf).at[1, 1, 4].set(np.inf)
  assert (np.asarray(greedy_ids(x)) == np.argmax(np.asarray(x), axis=-1)).all()


# Kept sets computed by hand (not through sampling.py's helpers): top_k keeps the k most likely and every
# token tied with the k-th (vLLM's and HF's `logits < kth` mask), then top_p the fewest most likely of those whose renormalized mass reaches top_p
# (the most likely always). Ids are out of probability order; dyadic probabilities make the boundary ties exact.
FILTER_CASES = [  # probs by id, temperature, top_p, top_k, kept ids
    ([.1, .4, .2, .3], 1.0, 0.3, 0, {1}),  # below the top token's mass: the top token alone
    ([.1, .4, .2, .3], 1.0, 0.5, 0, {1, 3}),
    ([.1, .4, .2, .3], 1.0, 0.95, 0, {0, 1, 2, 3}),
    ([.125, .5, .125, .25], 1.0, 0.5, 0, {1}),  # exactly the top token's mass
    ([.125, .5, .125, .25], 1.0, 0.75, 0, {1, 3}),  # exactly the top two's
    ([.125, .5, .125, .25], 1.0, 0.875, 0, {0, 1, 3}),  # a tie at the boundary: the lower id
    ([.125, .5, .125, .25], 1.0, 0.876, 0, {0, 1, 2, 3}),
    ([.125, .5, .125, .25], 1.0, 1.0, 2, {1, 3}),
    ([.125, .5, .125, .25], 1.0, 1.0, 3, {0, 1, 2, 3}),  # top_k at a tie: both tied ids (vLLM, HF)
    ([.375, .375, .125, .125], 1.0, 1.0, 1, {0, 1}),  # the logits [2, 2, 1, 0]-like tie at k = 1
    ([.125, .5, .125, .25], 1.0, 1.0, 1, {1}),
    ([.125, .5, .125, .25], 1.0, 0.6, 3, {1, 3}),  # both: the smaller set
    ([.125, .5, .125, .25], 1.0, 0.9, 2, {1, 3}),
    ([.25, .5, .125, .125], 1.0, 0.6, 2, {1}),  # top-p over the top-k renormalized (.5 / .75 >= .6), as vLLM / HF
    ([.25, .5, .125, .125], 1.0, 0.7, 2, {0, 1}),  # (top-p over all: .5 < .6 would keep {0, 1} above too)
    ([.125, .5, .125, .25], 0.5, 0.8, 0, {1, 3}),  # temperature first: probs ∝ p**2 = [1, 16, 1, 4] / 22
    ([.125, .5, .125, .25], 0.5, 0.7, 0, {1}),
]


def test_top_p_and_top_k_keep_the_hand_computed_sets():
  probs, temp, top_p, top_k, kept = zip(*FILTER_CASES)  # one row per case: one compile
  logits = np.log(np.array(probs, np.float32))  # [B,V]
  opts = np.array(temp, np.float32), np.array(top_p, np.float32), np.array(top_k, np.int32)  # [B] each
  p = np.asarray(row_probs(logits[:, None], *opts))[:, 0]  # [B,V]
  keys = jax.random.split(jax.random.key(1), (500, len(kept)))  # [n,B]: each kept token (p >= 0.1) is drawn
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_rows(logits, k, *opts)))(keys))  # [n,B]
  for i, want_set in enumerate(kept):
    assert set(np.flatnonzero(p[i]).tolist()) == want_set, (FILTER_CASES[i], p[i])
    want = np.where(np.isin(np.arange(p.shape[1]), list(want_set)), np.array(probs[i]) ** (1 / temp[i]), 0.0)
    np.testing.assert_allclose(p[i], want / want.sum(), atol=1e-6, err_msg=str(FILTER_CASES[i]))  # renormalized
    assert set(draws[:, i].tolist()) == want_set, FILTER_CASES[i]
