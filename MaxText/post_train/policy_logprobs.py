"""The trainer's log-probability of each token, scored as the serving engine drew it (RL's pi_theta,
pi_ref and, before any update, pi_old).

DeepSeek-V3.2 (sec. 3.1) keeps two things of the rollout when the trainer scores its tokens:
  keep routing        the MoE layers take the experts the engine routed each position to
                      (routed_experts, the model's forced-routing input; gate weights from the current router);
  keep sampling mask  the distribution is renormalized over the set the engine sampled from: the engine's
                      own kept ids (inference/rollout.py records them for a set of at most KEPT_IDS), for
                      the current and the reference policy alike. A larger set (a wide top-p) is recorded
                      as its size n only and rebuilt as the n largest of the scoring model's logits
                      (sampling.kept_mask with top_k = n): exact for an unfiltered row (n = the vocabulary),
                      an approximation for a wide top-p set once the policy has moved.
With both, before any update, `token_logprobs` of every sampled token equals the engine's recorded
logprob (inference/rollout.py) within 1e-4 in f32 (tests/integration/test_rollout_consistency.py).

Alignment: logp[b,t] = log p(tokens[b,t] | tokens[b,:t]) (the logits at position t - 1 score token t),
logp[:,0] = 0; kept[b,t] / kept_ids[b,t] are the kept set of the distribution token t was drawn from
(inference/rollout.py's Rollout.kept[i] sits at t = len(prompt) + i), routed_experts[b,t] the experts of
position t. Positions that were not sampled (the prompt, padding, a token after a segment boundary) mean
nothing: the caller masks them.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference import sampling
from MaxText.inference.rollout import KEPT_IDS


def token_logprobs(model, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, *,
                   temperature: float, kept: jax.Array | None = None, kept_ids: jax.Array | None = None,
                   routed_experts: jax.Array | None = None, sample_vocab: int | None = None) -> jax.Array:
  """tokens, positions, segment_ids [B,T] -> logp [B,T] f32 (see the module docstring for the alignment).

  temperature: the sampling temperature (0: the raw log-softmax, as the engine records greedy tokens).
  kept [B,T] int32 (the set's size) and kept_ids [B,T,C] int32 (its ids, -1 padded; used where kept <= C)
  or None: renormalize over the engine's kept set (see the module docstring), the scored token always in
  it. routed_experts [B,T,L_moe,k] int32 or None: keep routing (-1: that position routes freely).
  sample_vocab: ids at or past it are never drawn (the engine's sample_vocab), so they are outside every
  distribution."""
  logits, _ = model(tokens, positions, segment_ids, routed_experts=routed_experts)  # [B,T,V]
  return logprobs_of(logits, tokens, temperature=temperature, kept=kept, kept_ids=kept_ids, sample_vocab=sample_vocab)


def logprobs_of(logits: jax.Array, tokens: jax.Array, *, temperature: float, kept: jax.Array | None = None,
                kept_ids: jax.Array | None = None, sample_vocab: int | None = None) -> jax.Array:
  """logits [B,T,V] (position t predicts token t + 1), tokens [B,T] -> logp [B,T] f32 as token_logprobs."""
  lg = logits[:, :-1].astype(jnp.float32)  # [B,T-1,V]: position t - 1 scores token t
  target = tokens[:, 1:]  # [B,T-1]
  vocab = jnp.arange(lg.shape[-1], dtype=jnp.int32)  # [V]
  if sample_vocab is not None:
    lg = jnp.where(vocab < sample_vocab, lg, -jnp.inf)  # [B,T-1,V]
  if kept is not None:
    keep = kept_set(lg, kept[:, 1:], None if kept_ids is None else kept_ids[:, 1:], sample_vocab or lg.shape[-1])
    lg = jnp.where(keep | (vocab == target[..., None]), lg, -jnp.inf)  # [B,T-1,V]
  if temperature > 0:
    lg = lg / temperature
  lsm = jax.nn.log_softmax(lg, axis=-1)  # [B,T-1,V]
  logp = jnp.take_along_axis(lsm, target[..., None], axis=-1)[..., 0]  # [B,T-1]
  return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)  # [B,T]


def kept_set(lg: jax.Array, kept: jax.Array, kept_ids: jax.Array | None, finite: int) -> jax.Array:
  """The engine's kept sets as masks: logits [B,S,V], kept [B,S], kept_ids [B,S,C] or None, finite (the
  ids that can be drawn: sample_vocab or V) -> keep [B,S,V] bool. Where kept <= C the recorded ids; where
  kept >= finite every id; between, the kept largest of lg (no gradient through the order; the sort runs
  only when some position needs it)."""
  b, s, v = lg.shape
  c = 0 if kept_ids is None else kept_ids.shape[-1]
  keep = jnp.ones((b, s, v), bool)
  if c:
    if kept_ids.shape != (b, s, c):
      raise ValueError(f"kept_ids is {kept_ids.shape}: [B,T,C] beside tokens [B,T] (here B, T = {b}, {s + 1})")
    ids = jnp.where(kept_ids < 0, v, kept_ids)  # [B,S,C]: padding -> out of range, dropped
    recorded = jnp.zeros((b, s, v), bool).at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], ids].set(
        True, mode="drop")  # [B,S,V]
    keep = jnp.where((kept <= c)[..., None], recorded, keep)
  partial = (kept > c) & (kept < finite)  # [B,S]: a set larger than its record, smaller than the vocabulary
  rebuilt = lambda: sampling.kept_mask(jax.lax.stop_gradient(lg), 1.0, 1.0, kept)  # noqa: E731 [B,S,V]
  return jnp.where(partial[..., None], jax.lax.cond(jnp.any(partial), rebuilt, lambda: keep), keep)


def rollout_arrays(requests: Sequence, length: int, vocab_size: int, moe_layers: int, experts_per_tok: int) -> dict:
  """Finished rollout requests (inference/rollout.py records) as token_logprobs reads them, host numpy:
  tokens, positions, segment_ids (1 on prompt + generated tokens, 0 padding), kept (vocab_size outside the
  generated tokens) [N,length] int32, kept_ids [N,length,KEPT_IDS] int32 (-1 padded), routed_experts
  [N,length,L,k] int32 (-1 where not recorded), logp_old [N,length] f32 (the engine's, 0 outside the generated
  tokens) and generated [N,length] bool."""
  n = len(requests)
  a = {"tokens": np.zeros((n, length), np.int32), "segment_ids": np.zeros((n, length), np.int32),
       "kept": np.full((n, length), vocab_size, np.int32), "kept_ids": np.full((n, length, KEPT_IDS), -1, np.int32),
       "logp_old": np.zeros((n, length), np.float32),
       "generated": np.zeros((n, length), bool),
       "routed_experts": np.full((n, length, moe_layers, experts_per_tok), -1, np.int32),
       "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()}
  for i, r in enumerate(requests):
    ro, p = r.rollout, len(r.prompt)
    end = p + len(ro.tokens)
    a["tokens"][i, :end], a["segment_ids"][i, :end] = r.prompt + ro.tokens, 1
    a["kept"][i, p:end], a["logp_old"][i, p:end], a["generated"][i, p:end] = ro.kept, ro.logprobs, True
    a["routed_experts"][i, :len(ro.routed_experts)] = ro.routed_experts
    for j, ids in enumerate(ro.kept_ids):
      a["kept_ids"][i, p + j, :len(ids)] = ids
  return a


__all__ = ["token_logprobs", "logprobs_of", "kept_set", "rollout_arrays"]
