"""Multi-head Latent Attention (DeepSeek-V2/V3) with DeepSeek Sparse Attention (V3.2).

    q_lat        = q_norm(wq_a x)                         [b,t,q_lora]
    q            = wq_b q_lat -> [q_nope | q_pe]          [b,t,h,nope], [b,t,h,rope]
    c_kv, k_pe   = split(wkv_a x); c_kv = kv_norm(c_kv)   [b,s,kv_lora], [b,s,rope]  (k_pe shared by heads)
    k_nope, v    = split(wkv_b c_kv)                      [b,s,h,nope], [b,s,h,v]
    q_pe, k_pe   get interleaved YaRN RoPE
    logits       = (q_nope . k_nope + q_pe . k_pe) * softmax_scale      [b,h,t,s]
    out          = wo(softmax(logits + mask) v)           [b,t,D]

q_norm and kv_norm are RMSNorms with a FIXED eps of 1e-6 (LATENT_NORM_EPS), whatever
normalization_layer_epsilon says: DeepSeek's official MLA and HF's DeepseekV32Attention build
them with RMSNorm's default eps; only the decoder-layer and final norms follow rms_norm_eps.

With use_indexer, the lightning indexer scores every key for every query and the mask is
`valid & top-k selection` (the mask path: an additive mask on the dense logits). When a
query has k or fewer valid keys, the selection is all of them and this is dense attention.

Indexer training (indexer_training_stage, defined in indexer.STAGES): the stage says whether the
attention is dense (every valid key) or over the selection, and whether the indexer learns
L_I = KL(p_t || softmax(I_t)) over the keys attended to. aux["indexer_loss"] is the unweighted
per-layer L_I (indexer_kl_loss: mean over query tokens; 0 without one); the model applies
indexer_loss_weight. `capture_selection(model, ...)` runs a forward in which every layer sows
what its indexer selected (see there), with the indexer's recall of dense attention.

Two implementations of the sparse attention (sparse_attention_impl):
  mask    the above: a [b,t,s] selection mask over dense logits, O(t*s) time and memory.
  gather  sparse_attention.sparse_mla_attention: blocks of sparse_attention_query_block queries
          score, select and gather their k keys (absorbed MLA over c_kv and k_pe), O(t*k)
          attention and memory linear in t; the selection is sown as "indexer_topk_indices"
          [b,t,k] (-1 on invalid slots) instead of a mask.
  auto    mask below sparse_attention_gather_min_length keys, gather from there on (0: the
          backend's gather_min_length, kernels/backend.py).
A stage with dense attention and use_indexer=false always run the mask path. Where the mask path's
support is every valid key (no indexer, dense attention, or exact top-k >= the key count) and the backend
choice mask_attention is "splash" (kernels/backend.py), it runs in JAX's Pallas splash kernel instead
(`use_flash`, kernels/flash_attention.py): the same values, no [b,h,t,s] tensor in memory.

Context parallelism: queries stay sharded over `context` ([b,t/cp,...] per device: indexer
scores [b,t/cp,s]); the keys each query needs (c_kv, k_pe, the indexer key, their positions and
segments: the small latent, never the expanded per-head k/v) are all-gathered by
sharding.gather_sequence, which also undoes the zig-zag load-balancing order, so the key axis is
in original order and top-k ties break by original position on every mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.config.types import Config
from MaxText.kernels import backend
from MaxText.kernels.cached_attention import (
  absorbed_weights,
  key_kernel,
  merge_selected,
  value_kernel,
)
from MaxText.kernels.flash_attention import flash_attention, supports_length
from MaxText.kernels.index_scores import indexer_kl_loss
from MaxText.kernels.kl_target import flash_kl_target
from MaxText.kernels.low_rank import absorbed_out_delta, absorbed_q_delta
from MaxText.kernels.masks import attention_validity
from MaxText.kernels.selection import additive_mask
from MaxText.kernels.sparse_attention import (
  SparseKeys,
  SparseQueries,
  SparseSpec,
  absorb_q,
  gather_attend,
  sparse_mla_attention,
  unabsorb_out,
)
from MaxText.kernels.topk_indices import topk_indices
from MaxText.layers.embeddings import apply_rope_interleaved, rope_cos_sin, rope_inv_freq
from MaxText.layers.indexer import Indexer, indexer_stage
from MaxText.layers.linears import PRECISION, Linear, dtype_of
from MaxText.layers.normalizations import RMSNorm
from MaxText.runtime.sharding import constrain, gather_sequence

LATENT_NORM_EPS = 1e-6  # q_norm, kv_norm: the official RMSNorm default, not normalization_layer_epsilon


def attention_recall(probs: jax.Array, selected: jax.Array) -> jax.Array:
  """probs [b,h,t,s] (dense attention), selected [b,t,s] bool -> [b,t]: the fraction of each query's
  attention mass (summed over heads) on the selected keys; 0 for a query with no key."""
  p = jnp.sum(probs.astype(jnp.float32), axis=1)  # [b,t,s]
  return jnp.sum(jnp.where(selected, p, 0.0), axis=-1) / jnp.maximum(jnp.sum(p, axis=-1), 1e-30)


class MLA(nnx.Module):
  """MLA self-attention over a [b,t,D] sequence; the indexer (when enabled) picks the keys."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    d, h = config.emb_dim, config.num_query_heads
    self.num_heads = h
    self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    self.kv_lora = config.kv_lora_rank
    qk = self.nope + self.rope
    if config.q_lora_rank > 0:
      self.wq_a = Linear(d, config.q_lora_rank, config, axes=("embed", "q_lora"), rngs=rngs)
      self.q_norm = RMSNorm(config.q_lora_rank, config, eps=LATENT_NORM_EPS)
      self.wq_b = Linear(config.q_lora_rank, h * qk, config, axes=("q_lora", "q_heads"), rngs=rngs)
    else:  # no query LoRA: one projection (the indexer needs the latent, so use_indexer forbids this)
      self.wq = Linear(d, h * qk, config, axes=("embed", "q_heads"), rngs=rngs)
    self.wkv_a = Linear(d, self.kv_lora + self.rope, config, axes=("embed", "kv_lora"), rngs=rngs)
    self.kv_norm = RMSNorm(self.kv_lora, config, eps=LATENT_NORM_EPS)
    self.wkv_b = Linear(self.kv_lora, h * (self.nope + self.v_dim), config, axes=("kv_lora", "kv_heads"), rngs=rngs)
    self.wo = Linear(h * self.v_dim, d, config, axes=("q_heads", "embed"), rngs=rngs)
    self.indexer = Indexer(config, rngs=rngs) if config.use_indexer else None
    self.dtype = dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]
    self.record_selection = False  # set by capture_selection: sow what the indexer selected

  # ---- projections
  def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    cos, sin = rope_cos_sin(positions, rope_inv_freq(self.config, self.rope))  # [b,t,rope/2]
    return apply_rope_interleaved(x, cos, sin)

  def project_q(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """x [b,t,D], positions [b,t] -> q_nope [b,t,h,nope], q_pe [b,t,h,rope] (RoPE'd), q_lat [b,t,q_lora] | None."""
    b, t, _ = x.shape
    if self.config.q_lora_rank > 0:
      q_lat = self.q_norm(self.wq_a(x))  # [b,t,q_lora]
      q = self.wq_b(q_lat)  # [b,t,h*(nope+rope)]
    else:
      q_lat, q = None, self.wq(x)
    q = q.reshape(b, t, self.num_heads, self.nope + self.rope)  # [b,t,h,nope+rope]
    q = checkpoint_name(constrain(q, ("activation_batch", "activation_length", "activation_heads", None)), "query_proj")
    q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
    return q_nope, self._rope(q_pe, positions), q_lat

  def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [b,s,D], positions [b,s] -> c_kv [b,s,kv_lora] (normed), k_pe [b,s,rope] (RoPE'd): what a cache stores."""
    kv = self.wkv_a(x)  # [b,s,kv_lora+rope]
    c_kv = checkpoint_name(self.kv_norm(kv[..., :self.kv_lora]), "kv_latent")  # [b,s,kv_lora]
    k_pe = self._rope(kv[..., self.kv_lora:], positions)  # [b,s,rope], one rotary key shared by all heads
    return c_kv, k_pe

  def expand_kv(self, c_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """c_kv [b,s,kv_lora] -> k_nope [b,s,h,nope], v [b,s,h,v]."""
    b, s, _ = c_kv.shape
    kv = self.wkv_b(c_kv).reshape(b, s, self.num_heads, self.nope + self.v_dim)  # [b,s,h,nope+v]
    k_nope = checkpoint_name(kv[..., :self.nope], "key_proj")
    v = checkpoint_name(kv[..., self.nope:], "value_proj")
    return k_nope, v

  # ---- attention
  def joint_qk(self, q_nope: jax.Array, q_pe: jax.Array, k_nope: jax.Array, k_pe: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """-> q [b,t,h,nope+rope], k [b,s,h,nope+rope] in the compute dtype: one contraction over [nope | rope],
    the shared k_pe [b,s,rope] broadcast to every head. Two einsums (one with k_pe shared) cost more on
    the CPU: a [t,h,s] -> [h,t,s] transpose."""
    q_nope, q_pe, k_nope, k_pe = (a.astype(self.dtype) for a in (q_nope, q_pe, k_nope, k_pe))
    q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [b,t,h,nope+rope]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + k_pe.shape[-1:])],
                        axis=-1)  # [b,s,h,nope+rope]
    return q, k

  def attend(self, q_nope: jax.Array, q_pe: jax.Array, k_nope: jax.Array, k_pe: jax.Array, v: jax.Array,
             mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dense attention under a boolean mask [b,t,s] (True = attend) -> out [b,t,h,v], probs [b,h,t,s] fp32.

    Masked logits get a large negative FINITE value, so a row with no visible key gives a
    finite (uniform) softmax instead of NaN; its probabilities and output are then zeroed.
    """
    f32, p = jnp.float32, self.precision
    q, k = self.joint_qk(q_nope, q_pe, k_nope, k_pe)  # [b,t,h,nope+rope], [b,s,h,nope+rope]
    logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=p, preferred_element_type=f32)  # [b,h,t,s]
    logits = logits * self.config.softmax_scale + additive_mask(mask, f32)[:, None]  # [b,h,t,s]
    probs = jax.nn.softmax(logits, axis=-1)  # fp32 [b,h,t,s]
    probs = jnp.where(jnp.any(mask, axis=-1)[:, None, :, None], probs, 0.0)  # rows with no key: 0
    out = jnp.einsum("bhts,bshd->bthd", probs.astype(self.dtype), v.astype(self.dtype), precision=p)  # [b,t,h,v]
    return checkpoint_name(out, "attention_out"), probs

  def gather_keys(self, c_kv: jax.Array, k_pe: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Every key for this device's queries, in original order (sharding.gather_sequence): c_kv
    [b,s,kv_lora], k_pe [b,s,rope], key positions [b,s], key segments [b,s] | None. Without
    context parallelism this is the identity."""
    cfg = self.config
    c_kv = gather_sequence(c_kv, cfg, names=("activation_batch", None, None))
    k_pe = gather_sequence(k_pe, cfg, names=("activation_batch", None, None))
    k_pos = gather_sequence(positions, cfg, names=("activation_batch", None))
    k_seg = None if segment_ids is None else gather_sequence(segment_ids, cfg, names=("activation_batch", None))
    return c_kv, k_pe, k_pos, k_seg

  def use_gather(self, s: int) -> bool:
    """Whether a call over s keys takes the gather path (sparse_attention_impl; see the module doc)."""
    cfg = self.config
    if self.indexer is None or indexer_stage(cfg).dense_attention:
      return False  # nothing selected, or attention is dense by definition
    min_length = cfg.sparse_attention_gather_min_length or backend.choice("gather_min_length")
    return cfg.sparse_attention_impl == "gather" or (cfg.sparse_attention_impl == "auto" and s >= min_length)

  def use_flash(self, s: int) -> bool:
    """Whether the mask path's attention over s keys runs in the flash kernel (kernels/flash_attention.py,
    backend choice mask_attention "splash"): only where its support IS the validity mask, decided from the
    shapes and the stage alone: no indexer, or dense attention (dense_warmup), or exact top-k with
    indexer_topk >= s (every valid key selected: at most s are valid; an approximate top-k need not take
    them all). Also needed: splash's causal mask is validity's (no context parallelism: its keys are the
    queries, in order; positions the in-segment token order, the module invariant of flash_attention;
    rows and heads may be sharded: the kernel runs per shard), s a multiple of splash's 128, and no
    recording (capture_selection reads the probabilities)."""
    cfg = self.config
    if backend.choice("mask_attention") != "splash" or self.record_selection:
      return False
    if cfg.ici_context_parallelism != 1 or not supports_length(s):
      return False
    return self.indexer is None or indexer_stage(cfg).dense_attention or (
        cfg.indexer_topk >= s and not cfg.indexer_use_approx_top_k)

  def attend_flash(self, x: jax.Array, q_nope: jax.Array, q_pe: jax.Array, q_lat: jax.Array | None, k_nope: jax.Array,
                   k_pe: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array,
                   segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The mask path where its support is `valid` (use_flash), no [b,h,t,s] tensor kept -> out [b,t,h,v],
    indexer loss (f32): the same values as attend(..., valid) and indexer_kl_loss(probs, scores, valid)."""
    q, k = self.joint_qk(q_nope, q_pe, k_nope, k_pe)  # [b,t,h,nope+rope], [b,s,h,nope+rope]
    out = flash_attention(q, k, v.astype(self.dtype), segment_ids, self.config.softmax_scale)  # [b,t,h,v]
    indexer_loss = jnp.zeros((), jnp.float32)
    if self.indexer is not None and indexer_stage(self.config).indexer_loss:
      scores = self.indexer(x, q_lat, positions, valid)  # [b,t,s] fp32, -inf where not valid
      p = flash_kl_target(q, k, valid, segment_ids, self.config.softmax_scale,
                          precision=self.precision)  # [b,t,s], detached: the Pallas kernel (kernels/kl_target.py)
      indexer_loss = indexer_kl_loss(p[:, None], scores, valid)
    return checkpoint_name(out, "attention_out"), indexer_loss

  def sparse_spec(self) -> SparseSpec:
    """The gather kernel's static arguments, from the config."""
    cfg = self.config
    return SparseSpec(num_heads=self.num_heads, nope=self.nope, v=self.v_dim, scale=cfg.softmax_scale,
                      topk=cfg.indexer_topk, query_block=cfg.sparse_attention_query_block,
                      head_chunk=cfg.indexer_head_chunk, approx=cfg.indexer_use_approx_top_k,
                      recall_target=cfg.indexer_approx_top_k_recall,
                      with_kl=indexer_stage(cfg).indexer_loss, precision=self.precision,
                      block_remat=cfg.sparse_attention_block_remat)

  def attend_gather(self, x: jax.Array, q_nope: jax.Array, q_pe: jax.Array, q_lat: jax.Array, c_kv: jax.Array,
                    k_pe: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array]:
    """The gather path (sparse_attention.sparse_mla_attention) -> out [b,t,h,v], indexer loss (f32)."""
    x_d, q_lat_d = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_lat)  # the indexer's inputs are detached
    index_k = self.indexer.gathered_keys(x_d, positions)  # [b,s,d] all keys, original order
    index_q, index_w = self.indexer.queries(x_d, q_lat_d, positions)  # [b,t,H,d], [b,t,H]
    c_kv, k_pe, k_pos, k_seg = self.gather_keys(c_kv, k_pe, positions, segment_ids)
    result = sparse_mla_attention(
        SparseQueries(q_nope, q_pe, index_q, index_w, positions, segment_ids),
        SparseKeys(c_kv, k_pe, index_k, k_pos, k_seg), self.wkv_b.kernel_value(), self.sparse_spec(),
        self.wkv_b.low_rank(x.shape[0]))  # the adapter apart from the kernel (kernels/low_rank.py)
    if self.record_selection:  # the selection as indices: a [b,t,s] mask is what this path avoids
      self.sow(nnx.Intermediate, "indexer_topk_indices", jnp.where(result.idx_valid, result.idx, -1))
    return checkpoint_name(result.out, "attention_out"), result.indexer_loss

  def attend_cached(self, x: jax.Array, positions: jax.Array, cache) -> tuple[jax.Array, dict]:
    """Inference: t new tokens per row against a cache -> (out [b,t,D], the new tokens' cache
    entries {c_kv [b,t,kv_lora], k_pe [b,t,rope], idx_k [b,t,d_I]} for the engine to write).

    x [b,t,D] (normed), positions [b,t] consecutive per row (the row's next slots); `cache` is an
    inference.cache_view.CacheView of this layer: read only, its S slots hold the row's earlier
    tokens. Absorbed MLA (kernels/cached_attention.py): q_nope through wkv_b's key part, attention
    over the latents, out through wkv_b's value part; with cache.mode "sparse" each query attends
    to its indexer top-k (kernels.topk_indices: training's set, ties lowest position first),
    gathered through the cache, O(k) per query; "dense" to every valid slot.
    """
    cfg = self.config
    b, t, _ = x.shape
    h, nope, v = self.num_heads, self.nope, self.v_dim
    dt, precision = self.dtype, self.precision
    start = positions[:, 0]
    q_nope, q_pe, q_lat = self.project_q(x, positions)  # [b,t,h,nope], [b,t,h,rope], [b,t,q_lora]
    c_new, kpe_new = self.project_kv(x, positions)  # [b,t,kv_lora], [b,t,rope]
    entries = {"c_kv": c_new, "k_pe": kpe_new}
    if self.indexer is not None:
      entries["idx_k"] = self.indexer.keys(x, positions)  # [b,t,d_I]
    stored = {name: cache.stored(name, e) for name, e in entries.items()}  # what a read will return
    absorbed = cache.absorbed if cache.absorbed is not None else absorbed_weights(self.wkv_b.kernel_value(), h, nope, v)
    lora = self.wkv_b.low_rank(b)  # wkv_b's adapter (or each row's served one) apart from its kernel: low_rank.py
    q_abs = absorb_q(q_nope.astype(dt), key_kernel(absorbed).astype(dt), h, nope, 0, precision=precision,
                     delta=None if lora is None else absorbed_q_delta(q_nope, lora, nope, dt, precision)
                     )  # [b,t,h,kv_lora]
    q_pe = q_pe.astype(dt)
    if cache.mode == "sparse":
      q_i, w_i = self.indexer.queries(x, q_lat, positions)  # [b,t,h_I,d_I], [b,t,h_I]
      select = lambda scores: topk_indices(scores, cfg.indexer_topk, approx=cfg.indexer_use_approx_top_k,
                                           recall_target=cfg.indexer_approx_top_k_recall)  # [b,tq,S] -> [b,tq,k] each
      idx, idx_valid = cache.select_indexer(q_i, w_i, stored["idx_k"], positions, select,
                                            max_bytes=cfg.serve_max_index_score_bytes,
                                            precision=precision,
                                            fp8_queries=cfg.indexer_fp8_queries)  # blocks <= serve_max_index_score_bytes
      o_lat = cache.attend_selected(q_abs, q_pe, idx, idx_valid, stored["c_kv"], stored["k_pe"], start,
                                    cfg.softmax_scale)  # [b,1,h,kv_lora] where a kernel reads the pool, else None
      if o_lat is None:
        k = idx.shape[-1]
        flat = idx.reshape(b, t * k)  # [b,t*k]
        c_sel, pe_sel = merge_selected(*cache.gather(flat, dt), stored["c_kv"], stored["k_pe"], flat, start,
                                       dt)  # [b,t*k,kv_lora], [b,t*k,rope]
        o_lat, _ = gather_attend(q_abs, q_pe, c_sel, pe_sel, None, idx_valid, cfg.softmax_scale,
                                 precision=precision)  # [b,t,h,kv_lora]: query i's rows i*k .. i*k+k-1, in order
    elif cache.mode == "dense":
      o_lat = cache.attend_dense(q_abs, q_pe, stored["c_kv"], stored["k_pe"], positions, cfg.softmax_scale,
                                 precision)  # [b,t,h,kv_lora]
    else:
      raise ValueError(f"attention mode {cache.mode!r}: expected 'sparse' or 'dense'")
    out = unabsorb_out(o_lat.astype(dt), value_kernel(absorbed).astype(dt), h, 0, v, precision=precision,
                       delta=None if lora is None else absorbed_out_delta(o_lat, lora, nope, dt, precision)
                       )  # [b,t,h,v]
    return self.wo(out.reshape(b, t, h * v)), entries  # [b,t,D]

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, cache=None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [b,t,D], positions [b,t] (original token positions), segment_ids [b,t] | None (0 = padding)
    -> out [b,t,D], aux {"indexer_loss": scalar f32}. With a cache (inference): `attend_cached`,
    aux {"indexer_loss": 0, "cache_entries": the new tokens' entries}."""
    if cache is not None:
      out, entries = self.attend_cached(x, positions, cache)
      return out, {"indexer_loss": jnp.zeros((), jnp.float32), "cache_entries": entries}
    b, t, _ = x.shape
    stage = indexer_stage(self.config)
    q_nope, q_pe, q_lat = self.project_q(x, positions)  # [b,t,h,nope], [b,t,h,rope], [b,t,q_lora]
    c_kv, k_pe = self.project_kv(x, positions)  # [b,s,kv_lora], [b,s,rope]

    indexer_loss = jnp.zeros((), jnp.float32)
    if self.use_gather(t):
      out, indexer_loss = self.attend_gather(x, q_nope, q_pe, q_lat, c_kv, k_pe, positions, segment_ids)
    else:
      c_kv, k_pe, k_pos, k_seg = self.gather_keys(c_kv, k_pe, positions, segment_ids)  # s keys, original order
      k_nope, v = self.expand_kv(c_kv)  # [b,s,h,nope], [b,s,h,v]
      valid = attention_validity(positions, k_pos, segment_ids, k_seg)  # [b,t,s]
      if self.use_flash(t):
        out, indexer_loss = self.attend_flash(x, q_nope, q_pe, q_lat, k_nope, k_pe, v, positions, valid, segment_ids)
      elif self.indexer is None:
        out, _ = self.attend(q_nope, q_pe, k_nope, k_pe, v, valid)
      else:
        scores = self.indexer(x, q_lat, positions, valid)  # [b,t,s] fp32, -inf where not valid
        selected = self.indexer.select(scores) & valid  # [b,t,s]
        support = valid if stage.dense_attention else selected
        out, probs = self.attend(q_nope, q_pe, k_nope, k_pe, v, support)
        if stage.indexer_loss:
          indexer_loss = indexer_kl_loss(probs, scores, support)
        if self.record_selection:  # the selection, and its share of DENSE attention at this layer's input
          dense = probs if stage.dense_attention else \
              self.attend(q_nope, q_pe, k_nope, k_pe, v, valid)[1]  # [b,h,t,s]; only when recording
          self.sow(nnx.Intermediate, "indexer_mask", selected)
          self.sow(nnx.Intermediate, "indexer_recall", attention_recall(dense, selected))
    out = self.wo(out.reshape(b, t, self.num_heads * self.v_dim))  # [b,t,D]
    out = constrain(out, ("activation_batch", "activation_length", "activation_embed"))
    return out, {"indexer_loss": indexer_loss}


def capture_selection(model: nnx.Module, *args, **kwargs):
  """model(*args, **kwargs) under nnx.capture(model, nnx.Intermediate), every MLA recording what its
  indexer selected -> (outputs, intermediates). The mask path sows "indexer_mask" [b,t,s] and
  "indexer_recall" [b,t] (the selection's share of DENSE attention: one extra dense attention per
  layer, run only here); the gather path sows "indexer_topk_indices" [b,t,k] (-1 = invalid slot)."""
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, MLA)]
  for m in layers:
    m.record_selection = True
  try:
    return nnx.capture(model, nnx.Intermediate)(*args, **kwargs)
  finally:
    for m in layers:
      m.record_selection = False
