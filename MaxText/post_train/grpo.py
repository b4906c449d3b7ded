"""GRPO as DeepSeek-V3.2 trains with it (the paper's section 3.1): the loss as pure functions of arrays.

Notation: N = B x G sequences (B prompts, G samples each, a prompt's G samples adjacent), T token
positions; logp, logp_old, logp_ref [N,T] are log pi_theta, log pi_old (the distribution the engine
sampled from), log pi_ref (the frozen reference) of each sequence's token at t; `mask` [N,T] is 1 on
the completion's tokens (what was sampled), 0 on the prompt and padding.

  advantage       A_i = R_i - mean_j(R_j) over the G samples of a prompt (no division by the std)
  surrogate       min(r A_i, clip(r, 1 - eps, 1 + eps) A_i), r = exp(logp - logp_old), per token
  unbiased KL     (pi_theta / pi_old) * (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1), per token
                  (rl_unbiased_kl=false: the plain k3 estimate, without the importance ratio, as
                  GRPO's original and Tunix's); the gradient flows through both factors
  off-policy mask M_i = 0 when A_i < 0 and mean_t over sequence i's tokens of log(pi_old / pi_theta)
                  exceeds delta (A_i = 0 or a drift of exactly delta: kept); delta = -1: off. As the paper's
                  objective, M multiplies the clipped surrogate only: a masked sequence keeps its KL penalty
  per token       L_t = -(surrogate_t * M_i - beta * KL_t)
  aggregation     the paper's (and Tunix's default "sequence-mean-token-mean"): the mean of L over
                  each sequence's tokens, then the mean over the N sequences (a masked sequence's
                  surrogate counts as 0 in that mean, so masking does not rescale the others)

Invariants: with logp == logp_old and beta = 0 the loss is -mean_i(A_i) = 0 for every group, and its
gradient is -mean_i(A_i * mean_t grad logp_t): the REINFORCE gradient with a group baseline. Every
function is elementwise or a masked mean, so shapes are [N,T] -> [N,T] or [N].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GrpoOptions:
  """The loss's switches (config keys rl_epsilon, rl_beta, rl_offpolicy_delta, rl_unbiased_kl)."""
  epsilon: float = 0.2
  beta: float = 0.0  # 0: no KL term (and no reference model held)
  offpolicy_delta: float = -1.0  # < 0: off-policy sequence masking off
  unbiased_kl: bool = True

  @classmethod
  def from_config(cls, config) -> GrpoOptions:
    return cls(epsilon=config.rl_epsilon, beta=config.rl_beta, offpolicy_delta=config.rl_offpolicy_delta,
               unbiased_kl=config.rl_unbiased_kl)


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
  """rewards [N] (a prompt's G = group_size samples adjacent) -> A [N] = R_i - mean of its group."""
  r = rewards.reshape(-1, group_size)  # [B,G]
  return (r - r.mean(axis=1, keepdims=True)).reshape(-1)  # [N]


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """sum(x * mask) / max(sum(mask), 1) over `axis` (a sequence with no token gives 0, not NaN)."""
  return (x * mask).sum(axis=axis) / jnp.maximum(mask.sum(axis=axis), 1.0)


def clipped_surrogate(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, epsilon: float):
  """[N,T], [N,T], A [N] -> (min(r A, clip(r, 1-eps, 1+eps) A) [N,T], clipped [N,T] bool: the clipped
  term is the smaller one, so that token's gradient is zero)."""
  ratio = jnp.exp(logp - logp_old)  # [N,T]
  a = advantages[:, None]  # [N,1]
  unclipped = ratio * a
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon) * a
  return jnp.minimum(unclipped, clipped), clipped < unclipped


def kl_estimate(logp: jax.Array, logp_old: jax.Array, logp_ref: jax.Array, unbiased: bool = True) -> jax.Array:
  """Per token [N,T]: k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (>= 0), times pi_theta/pi_old when
  `unbiased` (the paper's correction: the tokens were drawn from pi_old, not pi_theta)."""
  log_ratio_ref = logp_ref - logp  # log(pi_ref / pi_theta)
  k3 = jnp.exp(log_ratio_ref) - log_ratio_ref - 1.0
  return jnp.exp(logp - logp_old) * k3 if unbiased else k3


def offpolicy_keep(logp: jax.Array, logp_old: jax.Array, mask: jax.Array, advantages: jax.Array,
                   delta: float) -> jax.Array:
  """M [N] float: 0 for a sequence with A_i < 0 whose mean over its tokens of log(pi_old / pi_theta)
  exceeds delta, else 1 (all 1 when delta < 0). A mask, not a path for gradients."""
  if delta < 0:
    return jnp.ones(advantages.shape, jnp.float32)
  drift = masked_mean(jax.lax.stop_gradient(logp_old - logp), mask, axis=1)  # [N]
  return jnp.where((advantages < 0) & (drift > delta), 0.0, 1.0)


def grpo_loss(logp: jax.Array, logp_old: jax.Array, logp_ref: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, options: GrpoOptions) -> tuple[jax.Array, dict]:
  """The scalar loss and its metrics: kl (mean per completion token, before masking), clip_fraction
  (completion tokens whose clipped term is the min), masked_fraction (sequences the off-policy mask
  drops), ratio_mean, advantage_abs_mean. logp_ref may be None when beta = 0."""
  mask = mask.astype(jnp.float32)
  surrogate, clipped = clipped_surrogate(logp, logp_old, advantages, options.epsilon)  # [N,T]
  kl = jnp.zeros_like(logp)
  if logp_ref is not None:
    kl = kl_estimate(logp, logp_old, logp_ref, options.unbiased_kl)  # [N,T]
  keep = offpolicy_keep(logp, logp_old, mask, advantages, options.offpolicy_delta)  # [N]
  per_token = surrogate * keep[:, None]  # [N,T]: the mask drops the surrogate, never the KL penalty
  if logp_ref is not None and options.beta:
    per_token = per_token - options.beta * kl
  per_sequence = masked_mean(-per_token, mask, axis=1)  # [N]
  metrics = {"kl": masked_mean(jax.lax.stop_gradient(kl), mask),
             "clip_fraction": masked_mean(clipped.astype(jnp.float32), mask),
             "masked_fraction": 1.0 - keep.mean(),
             "ratio_mean": masked_mean(jax.lax.stop_gradient(jnp.exp(logp - logp_old)), mask),
             "advantage_abs_mean": jnp.abs(advantages).mean()}
  return per_sequence.mean(), metrics
