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
