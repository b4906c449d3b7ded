"""MaxText/post_train/grpo.py: each formula against a float64 numpy reference written from the paper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.post_train import grpo

N, T, G = 6, 5, 3  # 2 prompts x 3 samples, 5 positions


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  logp = np.log(rng.uniform(0.05, 0.95, (N, T)))
  logp_old = logp + rng.normal(0, 0.3, (N, T))
  logp_ref = logp + rng.normal(0, 0.3, (N, T))
  rewards = rng.integers(0, 2, N).astype(np.float64)
  mask = np.zeros((N, T))
  for i, n in enumerate([5, 3, 1, 4, 2, 5]):
    mask[i, T - n:] = 1.0  # completions end-aligned, prompts before them
  return logp, logp_old, logp_ref, rewards, mask


def _ref_loss(logp, logp_old, logp_ref, rewards, mask, eps, beta, delta, unbiased):
  """The paper's objective, negated, one sequence and one token at a time in float64."""
  adv = np.empty(N)
  for p in range(N // G):
    group = rewards[p * G:(p + 1) * G]
    adv[p * G:(p + 1) * G] = group - group.mean()
  total = 0.0
  for i in range(N):
    toks = [t for t in range(T) if mask[i, t]]
    drift = np.mean([logp_old[i, t] - logp[i, t] for t in toks])
    m = 0.0 if delta >= 0 and adv[i] < 0 and drift > delta else 1.0  # the paper's M_i: on the surrogate only
    seq = 0.0
    for t in toks:
      r = np.exp(logp[i, t] - logp_old[i, t])
      surr = min(r * adv[i], np.clip(r, 1 - eps, 1 + eps) * adv[i])
      q = np.exp(logp_ref[i, t] - logp[i, t])
      kl = (q - np.log(q) - 1) * (r if unbiased else 1.0)
      seq += -(surr * m - beta * kl)
    total += seq / len(toks)
  return total / N, adv


@pytest.mark.parametrize("eps,beta,delta,unbiased", [(0.2, 0.0, -1.0, True), (0.2, 0.1, -1.0, True),
                                                     (0.1, 0.1, -1.0, False), (0.2, 0.05, 0.05, True)])
def test_loss_matches_the_float64_reference(eps, beta, delta, unbiased):
  logp, logp_old, logp_ref, rewards, mask = _inputs()
  want, adv = _ref_loss(logp, logp_old, logp_ref, rewards, mask, eps, beta, delta, unbiased)
  got_adv = grpo.group_advantages(jnp.asarray(rewards, jnp.float32), G)
  np.testing.assert_allclose(got_adv, adv, atol=1e-6)
  opts = grpo.GrpoOptions(epsilon=eps, beta=beta, offpolicy_delta=delta, unbiased_kl=unbiased)
  f32 = [jnp.asarray(x, jnp.float32) for x in (logp, logp_old, logp_ref)]
  loss, metrics = grpo.grpo_loss(*f32, got_adv, jnp.asarray(mask), opts)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)


def test_each_term_matches_the_float64_reference():
  logp, logp_old, logp_ref, _, mask = _inputs(1)
  adv = np.array([0.5, -0.25, -0.25, 1.0, -1.0, 0.0])
  r = np.exp(logp - logp_old)
  surr, clipped = grpo.clipped_surrogate(*(jnp.asarray(x, jnp.float32) for x in (logp, logp_old, adv)), 0.2)
  want = np.minimum(r * adv[:, None], np.clip(r, 0.8, 1.2) * adv[:, None])
  np.testing.assert_allclose(surr, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(clipped, np.clip(r, 0.8, 1.2) * adv[:, None] < r * adv[:, None])
  q = np.exp(logp_ref - logp)
  for unbiased, want_kl in ((True, r * (q - np.log(q) - 1)), (False, q - np.log(q) - 1)):
    kl = grpo.kl_estimate(*(jnp.asarray(x, jnp.float32) for x in (logp, logp_old, logp_ref)), unbiased)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-4, atol=1e-7)
  assert (np.asarray(grpo.kl_estimate(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(logp_ref))) >= 0).all()


def test_offpolicy_masking_drops_only_negative_advantage_sequences_past_delta():
  logp = jnp.zeros((4, 3))
  # mean log(pi_old / pi_theta) over the completion tokens: 0.3, 0.3, 0.05, 0.3
  logp_old = jnp.array([[0.3, 0.3, 0.3], [0.3, 0.3, 0.3], [0.05, 0.05, 0.05], [9.0, 0.3, 0.3]])
  mask = jnp.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]], jnp.float32)  # row 3's 9.0 is a prompt token
  adv = jnp.array([-1.0, 1.0, -1.0, -1.0])
  keep = grpo.offpolicy_keep(logp, logp_old, mask, adv, delta=0.1)
  np.testing.assert_array_equal(keep, [0.0, 1.0, 1.0, 0.0])  # positive A kept; under delta kept
  np.testing.assert_array_equal(grpo.offpolicy_keep(logp, logp_old, mask, adv, delta=-1.0), [1, 1, 1, 1])
  # the boundaries: A = 0 is kept however far it drifted; a drift of exactly delta is kept (dyadic: exact in f32)
  edge = grpo.offpolicy_keep(jnp.zeros((2, 3)), jnp.array([[0.3] * 3, [0.25] * 3]), jnp.ones((2, 3)),
                             jnp.array([0.0, -1.0]), delta=0.25)
  np.testing.assert_array_equal(edge, [1.0, 1.0])
  opts = grpo.GrpoOptions(epsilon=10.0, offpolicy_delta=0.1)
  loss, metrics = grpo.grpo_loss(logp, logp_old, None, adv, mask, opts)
  r = np.exp(-np.array([0.3, 0.05]))  # rows 1 and 2 contribute, rows 0 and 3 nothing
  np.testing.assert_allclose(float(loss), -(r[0] * 1.0 + r[1] * -1.0) / 4, rtol=1e-6)
  assert float(metrics["masked_fraction"]) == 0.5


def test_a_masked_sequence_keeps_its_kl_penalty():
  """The paper multiplies only the clipped surrogate by M_i: a masked sequence's loss is beta * its mean KL."""
  logp, logp_old, logp_ref = jnp.zeros((1, 2)), jnp.full((1, 2), 0.5), jnp.full((1, 2), -0.5)
  opts = grpo.GrpoOptions(beta=0.1, offpolicy_delta=0.1, unbiased_kl=False)
  loss, metrics = grpo.grpo_loss(logp, logp_old, logp_ref, jnp.array([-1.0]), jnp.ones((1, 2)), opts)
  assert float(metrics["masked_fraction"]) == 1.0
  np.testing.assert_allclose(float(loss), 0.1 * (np.exp(-0.5) + 0.5 - 1), rtol=1e-6)


def test_on_policy_gradient_is_reinforce_with_the_group_baseline():
  """logp == logp_old, beta 0: d loss / d logp[i,t] = -A_i / (|o_i| N) on completion tokens, 0 elsewhere."""
  logp, _, _, rewards, mask = _inputs(2)
  adv = grpo.group_advantages(jnp.asarray(rewards, jnp.float32), G)
  grad = jax.grad(lambda lp: grpo.grpo_loss(lp, jax.lax.stop_gradient(lp), None, adv, jnp.asarray(mask),
                                            grpo.GrpoOptions())[0])(jnp.asarray(logp, jnp.float32))
  want = -np.asarray(adv)[:, None] * mask / mask.sum(1, keepdims=True) / N
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
