"""The lightning indexer of DeepSeek Sparse Attention: which keys each query attends to.

Official DeepSeek-V3.2 math (after the 2025-11-17 RoPE fix):

    q_I = wq_b(q_lat)                     [b,t,h,d]   from MLA's query latent
    k_I = LayerNorm(wk(x))                [b,s,d]     one key per token, shared by all heads
    RoPE, NON-interleaved (rotate-half), on the first qk_rope_head_dim dims of q_I and k_I
    optional Hadamard rotation of q_I and k_I (orthogonal: q.k is unchanged)
    w   = weights_proj(x) * h**-0.5       [b,t,h]     fp32
    I[t,s] = sum_h w[t,h] * d**-0.5 * relu(q_I[t,h] . k_I[s])       (-inf where not valid)

then top-k over s selects the keys. The indexer reads detached inputs: it never sends
gradient into the main model, and learns only from the indexer KL loss on its scores.

The scores and the indexer's KL loss are computed in kernels/index_scores.py, the selection
(top-k, fast threshold masks, the reference mask) in kernels/selection.py; this module holds the
indexer's parameters, its projections, and what each training stage means (`STAGES`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config.types import Config
from MaxText.kernels.index_scores import index_scores
from MaxText.kernels.selection import additive_mask, generate_mask, topk_mask
from MaxText.layers.embeddings import apply_rope_half, rope_cos_sin, rope_inv_freq
from MaxText.layers.linears import PRECISION, Linear
from MaxText.layers.normalizations import LayerNorm
from MaxText.runtime.sharding import constrain, gather_sequence


def hadamard_matrix(d: int) -> np.ndarray:
  """The normalized Sylvester Hadamard matrix [d,d] (d a power of 2): symmetric and orthogonal."""
  if d < 1 or d & (d - 1):
    raise ValueError(f"hadamard_matrix: d={d} must be a power of 2")
  h = np.ones((1, 1), np.float64)
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return (h / np.sqrt(d)).astype(np.float32)


class IndexerStage(NamedTuple):
  """What one `indexer_training_stage` means: the one definition that MLA, the trainer and base.yml follow.

  L_I = KL(p_t || softmax(I_t)) over the keys the main attention attends to (indexer_kl_loss):
  p_t is the main attention's probabilities summed over heads, L1-normalized and detached; the
  indexer's inputs are detached too, so L_I trains only the indexer, and the attention sends no
  gradient into the indexer (the selection is boolean).
  """
  dense_attention: bool  # the main attention attends to every valid key (else to the selection)
  indexer_loss: bool  # the indexer learns L_I (over all valid keys when dense, else over its selection)
  trains_main_model: bool  # every parameter outside the indexers trains on the LM loss (else frozen)


STAGES = {
    "none": IndexerStage(dense_attention=False, indexer_loss=False, trains_main_model=True),  # a fixed selector
    "dense_warmup": IndexerStage(dense_attention=True, indexer_loss=True, trains_main_model=False),
    "sparse": IndexerStage(dense_attention=False, indexer_loss=True, trains_main_model=True),
}


def indexer_stage(config: Config) -> IndexerStage:
  """The stage in force: `indexer_training_stage`, or "none" without an indexer."""
  return STAGES[config.indexer_training_stage if config.use_indexer else "none"]


class Indexer(nnx.Module):
  """Lightning indexer parameters and the projections that feed `index_scores`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    self.n_heads = config.indexer_n_heads
    self.head_dim = config.indexer_head_dim
    self.rope_dim = config.qk_rope_head_dim
    self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, config, axes=("q_lora", "q_heads"), rngs=rngs)
    self.wk = Linear(config.emb_dim, self.head_dim, config, axes=("embed", "head_dim"), rngs=rngs)
    self.k_norm = LayerNorm(self.head_dim, config, eps=1e-6)
    self.weights_proj = Linear(config.emb_dim, self.n_heads, config, axes=("embed", "q_heads"), rngs=rngs,
                               dtype=jnp.float32, block_quantized=False)

  # ---- projections
  def _rope_and_rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [b,t,...,d]: rotate-half RoPE on x[..., :rope_dim], the rest passes; then the optional Hadamard."""
    cos, sin = rope_cos_sin(positions, rope_inv_freq(self.config, self.rope_dim))  # [b,t,rope/2]
    x = jnp.concatenate([apply_rope_half(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]], axis=-1)
    if self.config.indexer_hadamard:
      hm = jnp.asarray(hadamard_matrix(self.head_dim), x.dtype)
      x = jnp.einsum("...d,de->...e", x, hm, precision=PRECISION[self.config.matmul_precision])
    return x

  def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [b,s,D], positions [b,s] -> k [b,s,d]: what a decode cache stores (one key per token)."""
    k = self.k_norm(self.wk(x))  # [b,s,d]
    return self._rope_and_rotate(k, positions)

  def gathered_keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Every key for this device's queries: `keys` all-gathered along the sequence and, under
    zig-zag load balancing, back in ORIGINAL order (sharding.gather_sequence) -> [b,s,d]."""
    return gather_sequence(self.keys(x, positions), self.config, names=("activation_batch", None, None))

  def queries(self, x: jax.Array, q_lat: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [b,t,D], q_lat [b,t,q_lora], positions [b,t] -> q [b,t,h,d], w [b,t,h] fp32 (times h**-0.5)."""
    b, t, _ = q_lat.shape
    q = self.wq_b(q_lat).reshape(b, t, self.n_heads, self.head_dim)  # [b,t,h,d]
    q = self._rope_and_rotate(q, positions)
    w = self.weights_proj(x.astype(jnp.float32)) * self.n_heads ** -0.5  # [b,t,h] fp32
    return q, w

  def __call__(self, x: jax.Array, q_lat: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """x [b,t,D], q_lat [b,t,q_lora], positions [b,t], valid [b,t,s=t] bool -> scores [b,t,s] fp32.

    The key axis is `gathered_keys`' (original order under context parallelism): valid must use
    the key positions in that order (MLA.gather_keys). Inputs are detached: the scores depend on
    the main model's activations but carry no gradient back into them; the indexer's own
    parameters still get gradients.
    """
    x = jax.lax.stop_gradient(x)
    q_lat = jax.lax.stop_gradient(q_lat)
    k = self.gathered_keys(x, positions)  # [b,s,d]
    q, w = self.queries(x, q_lat, positions)  # [b,t,h,d], [b,t,h]
    scores = index_scores(q, w, k, valid, head_chunk=self.config.indexer_head_chunk,
                          precision=PRECISION[self.config.matmul_precision])  # [b,t,s]
    return constrain(scores, ("activation_batch", "activation_length", None))

  # ---- selection
  def select(self, scores: jax.Array) -> jax.Array:
    """scores [b,t,s] -> bool mask [b,t,s], True = selected.

    k' = min(indexer_topk, s). Exact (default): the k-th value from the fast threshold, then
    the mask keeps exactly k' keys (indexer_mask_exact_topk, ties lowest position first) or
    every key >= the threshold. Approximate (indexer_use_approx_top_k): approx top-k at
    indexer_approx_top_k_recall; the mask is its index set (exact_topk) or its k-th value as
    a raw cutoff. Both in one pass over the scores where that pays (selection.topk_mask), so
    no indices come back: the gather path takes them from topk_indices.topk_indices.
    A -inf (not valid) score is never selected. The mask carries no gradient.
    """
    cfg = self.config
    k = min(cfg.indexer_topk, scores.shape[-1])
    return topk_mask(scores, k, exact_topk=cfg.indexer_mask_exact_topk, approx=cfg.indexer_use_approx_top_k,
                     recall_target=cfg.indexer_approx_top_k_recall)

  def generate_mask(self, index_score: jax.Array, topk_values: jax.Array, topk_indices: jax.Array | None = None,
                    *, k: int | None = None, dtype=jnp.float32) -> jax.Array:
    """The ADDITIVE mask [b,t,s] (0 = attend, large negative = masked) from top-k values/indices,
    following indexer_mask_exact_topk (exactly k keys) or the raw >= k-th value cutoff."""
    mask = generate_mask(index_score, topk_values, topk_indices, exact_topk=self.config.indexer_mask_exact_topk,
                         k=k)
    return additive_mask(mask, dtype)


__all__ = ["Indexer", "IndexerStage", "STAGES", "indexer_stage", "hadamard_matrix"]
