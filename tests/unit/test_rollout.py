"""The engine's rollout records on the device (MaxText/inference/rollout.py sampled_logprobs) and the
trainer's scoring of them (MaxText/post_train/policy_logprobs.py logprobs_of), against float64 numpy:
the kept size is the hand-computed top_p / top_k set, the logprob is renormalized over it; the trainer,
given that size, scores the same distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference.rollout import sampled_logprobs
from MaxText.post_train.policy_logprobs import logprobs_of

V = 32
# (temperature, top_p, top_k) per row: unfiltered, top_p, top_k, both, greedy (filters ignored), hot top_p
OPTIONS = [(1.0, 1.0, 0), (1.0, 0.6, 0), (0.7, 1.0, 5), (1.3, 0.8, 4), (0.0, 0.5, 3), (2.0, 0.3, 0)]


def np_kept_and_logprob(lg, tok, temp, p, k):
  """float64: the kept set (sorted by logit, ties lowest id first; mass strictly ahead < top_p, rank <
  top_k) and tok's log-prob renormalized over it at temperature (greedy: the raw log-softmax)."""
  lg = np.asarray(lg, np.float64)
  if temp == 0 or (p >= 1 and k <= 0):
    z = lg / (temp or 1.0)
    return V, z[tok] - np.log(np.exp(z - z.max()).sum()) - z.max()
  order = np.argsort(-lg, kind="stable")
  z = lg[order] / temp
  probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  before = np.cumsum(probs) - probs
  keep = (before < p) & ((k <= 0) | (np.arange(V) < k))
  kz = z[keep]
  lse = kz.max() + np.log(np.exp(kz - kz.max()).sum())
  return int(keep.sum()), z[list(order).index(tok)] - lse


def test_kept_size_and_logprob_are_the_hand_computed_top_p_top_k_set():
  logits = jax.random.normal(jax.random.key(0), (len(OPTIONS), V)) * 2.0  # [B,V]
  temp, top_p, top_k = (jnp.asarray(c) for c in zip(*OPTIONS))
  order = np.argsort(-np.asarray(logits), axis=-1, kind="stable")
  tokens = jnp.asarray(order[np.arange(len(OPTIONS)), [0, 1, 0, 2, 0, 0]], jnp.int32)  # each inside its row's kept set
  logp, kept = jax.jit(sampled_logprobs)(logits, tokens, temp, top_p, top_k)
  for b, opts in enumerate(OPTIONS):
    want_kept, want_lp = np_kept_and_logprob(logits[b], int(tokens[b]), *opts)
    assert int(kept[b]) == want_kept, (b, opts)
    np.testing.assert_allclose(float(logp[b]), want_lp, atol=1e-5, err_msg=str(opts))
  assert 1 < int(kept[1]) < V and int(kept[2]) == 5  # the cases that matter are not trivial


def test_trainer_scores_the_recorded_kept_set_at_the_recorded_temperature():
  logits = jax.random.normal(jax.random.key(1), (2, 5, V)) * 2.0  # [B,T,V]: position t scores token t+1
  tokens = jnp.asarray(np.argsort(-np.asarray(logits), axis=-1)[:, :, 1], jnp.int32)  # [B,T] second best
  tokens = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tokens[:, :-1]], axis=1)  # token t from position t-1
  kept = jnp.asarray([[V, 3, 1, 7, V], [V, 2, V, 4, 10]], jnp.int32)  # kept 1: the token is kept anyway
  logp = np.asarray(logprobs_of(logits, tokens, temperature=0.8, kept=kept))
  assert (logp[:, 0] == 0).all()
  for b in range(2):
    for t in range(1, 5):
      lg = np.asarray(logits[b, t - 1], np.float64)
      keep = np.argsort(-lg, kind="stable")[:int(kept[b, t])].tolist() + [int(tokens[b, t])]
      z = lg[sorted(set(keep))] / 0.8
      want = lg[int(tokens[b, t])] / 0.8 - (z.max() + np.log(np.exp(z - z.max()).sum()))
      np.testing.assert_allclose(logp[b, t], want, atol=1e-5, err_msg=f"{b},{t}")
