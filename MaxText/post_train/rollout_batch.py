"""A GRPO step's rollouts as the trainer reads them, and what it computes over them (MaxText/rl.py is the loop).

    batch = assemble(config, requests, rewards)          # finished rollout requests -> Batch (host numpy)
    logp = scored_logprobs(config, model, arrays, vocab)  # log pi [N,T] with the recorded routing / kept sets
    agreement = routing_agreement(model, arrays, batch.routed_experts)
    loss_fn = grpo_loss_fn(options, vocab)               # train.make_train_step's loss_fn

N = rl_prompts_per_step x rl_num_generations sequences (a prompt's G samples adjacent), T = max_target_length.
A request's records are inference/rollout.py's (Request.rollout: tokens, logprobs, kept, kept_ids, routed_experts);
the arrays are post_train/policy_logprobs.rollout_arrays', plus the completion mask and the group advantages
(post_train/grpo.py). Everything here is a pure function of arrays or of a model: no engine, no train state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint import model_state
from MaxText.config.types import Config
from MaxText.post_train import grpo
from MaxText.post_train.policy_logprobs import rollout_arrays, token_logprobs


@dataclasses.dataclass
class Batch:
  """A step's rollouts as the loss reads them, host numpy [N,T] (N = B x G, T = max_target_length)."""
  arrays: dict  # tokens, positions, segment_ids, mask, logp_old, advantages [N]; kept, kept_ids, routed_experts: switches
  routed_experts: np.ndarray | None  # [N,T,L,k] the engine's routing (routing agreement), None without MoE
  rewards: np.ndarray  # [N]
  generated: int  # tokens the engine sampled


def assemble(config: Config, requests: list, rewards: np.ndarray) -> Batch:
  """Finished rollout requests (a prompt's G samples adjacent) as the loss's arrays, with the completion
  mask and the group advantages; kept / routed_experts in the arrays only where rl_keep_sampling_mask /
  rl_keep_routing (Batch.routed_experts always, for the routing agreement)."""
  moe = config.num_moe_layers
  a = rollout_arrays(requests, config.max_target_length, config.vocab_size, moe, config.num_experts_per_tok)
  a["mask"] = a.pop("generated").astype(np.float32)  # [N,T]: the sampled tokens (the stop token included)
  a["advantages"] = np.asarray(grpo.group_advantages(jnp.asarray(rewards), config.rl_num_generations))  # [N]
  routed_experts = a.pop("routed_experts") if moe else None
  if config.rl_keep_routing and moe:
    a["routed_experts"] = routed_experts
  if not config.rl_keep_sampling_mask:
    del a["kept"], a["kept_ids"]
  return Batch(a, routed_experts, rewards, sum(len(r.rollout.tokens) for r in requests))


def scored_logprobs(config: Config, model, arrays: dict, sample_vocab: int | None) -> jax.Array:
  """log pi [N,T] of each token under `model` at the sampling temperature, with the arrays' recorded
  routing and kept sets when they carry them (rl_keep_routing, rl_keep_sampling_mask)."""
  return token_logprobs(model, arrays["tokens"], arrays["positions"], arrays["segment_ids"],
                        temperature=config.decode_sampling_temperature, kept=arrays.get("kept"),
                        kept_ids=arrays.get("kept_ids"), routed_experts=arrays.get("routed_experts"),
                        sample_vocab=sample_vocab)


def routing_agreement(model, arrays: dict, routed_experts: jax.Array) -> jax.Array:
  """The fraction of (computed position, MoE layer) pairs where the model's own routing picks the same
  experts as the engine recorded (routed_experts [N,T,L,k], -1 where the engine computed nothing)."""
  _, aux = model(arrays["tokens"], arrays["positions"], arrays["segment_ids"])
  same = (jnp.sort(aux["routed_experts"], -1) == jnp.sort(routed_experts, -1)).all(-1)  # [N,T,L]
  where = (routed_experts[..., 0] >= 0) & (arrays["segment_ids"][..., None] > 0)  # [N,T,L]
  return (same & where).sum() / jnp.maximum(where.sum(), 1)


def grpo_loss_fn(options: grpo.GrpoOptions, sample_vocab: int | None):
  """train.make_train_step's loss_fn: the GRPO loss of a batch (its metrics, no expert loads: the RL
  step leaves the routing biases as the engine routed with them)."""

  def loss_fn(config, graphdef, params, buffers, mb):
    logp = scored_logprobs(config, model_state.merge(graphdef, params, buffers), mb, sample_vocab)  # [N,T]
    loss, metrics = grpo.grpo_loss(logp, mb["logp_old"], mb.get("logp_ref"), mb["advantages"], mb["mask"], options)
    return loss, (dict(metrics, loss=loss), {})

  return loss_fn


__all__ = ["Batch", "assemble", "grpo_loss_fn", "routing_agreement", "scored_logprobs"]
