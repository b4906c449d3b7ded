"""STAND-IN until branch i42a's MaxText/post_train/policy_logprobs.py is merged (then this file goes).

token_logprobs with the contract's signature, computed by a plain forward: the routing is the model's
own (routed_experts ignored) and the distribution is the full softmax at `temperature` (kept ignored).
Alignment: logp[b,t] = log p(tokens[b,t] | tokens[b,:t]) at `temperature`, logp[:,0] = 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(model, tokens, positions, segment_ids, *, temperature: float, kept=None, routed_experts=None):
  """tokens, positions, segment_ids [B,T] -> logp [B,T] f32 (kept and routed_experts: ignored here)."""
  del kept, routed_experts
  logits, _ = model(tokens, positions, segment_ids)  # [B,T,V]
  logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)  # [B,T-1,V]
  picked = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]  # [B,T-1]
  return jnp.pad(picked, ((0, 0), (1, 0)))  # [B,T]
