"""The lightning indexer's scores and its KL loss, as the layers and the gather kernel compute them.

    I[t,s] = sum_h w[t,h] * d**-0.5 * relu(q[t,h] . k[s])      (-inf where not valid)
    L_I    = mean over queries of KL(p_t || softmax(I_t)) over a support (all valid or selected keys)

`index_scores` scores every key in head chunks (never [b,t,s,h] live); `gathered_index_scores`
scores only each query's k selected keys (O(t*k)); `indexer_kl_loss` is the indexer's training
loss for either. layers/indexer.py holds the projections that produce q, w and k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.kernels.topk_indices import gather_rows


def _over_head_chunks(qf: jax.Array, wf: jax.Array, chunk_scores, init: jax.Array, head_chunk: int,
                      remat: bool) -> jax.Array:
  """sum over head chunks of chunk_scores(q_c [..., c, d], w_c [..., c]) for qf [..., h, d], wf [..., h]
  (a lax.scan accumulating into init, shaped as one chunk's scores; `head_chunk` heads at a time; one call when they all fit). A
  head count that head_chunk does not divide is padded with zero-weight heads (relu(0) * 0 = 0 exactly)."""
  h, d = qf.shape[-2:]
  if head_chunk >= h:
    return chunk_scores(qf, wf)
  n = -(-h // head_chunk)
  pad = n * head_chunk - h
  if pad:
    qf = jnp.pad(qf, [(0, 0)] * (qf.ndim - 2) + [(0, pad), (0, 0)])
    wf = jnp.pad(wf, [(0, 0)] * (wf.ndim - 1) + [(0, pad)])
  lead = qf.shape[:-2]
  q_chunks = jnp.moveaxis(qf.reshape(*lead, n, head_chunk, d), -3, 0)  # [n, ..., c, d]
  w_chunks = jnp.moveaxis(wf.reshape(*lead, n, head_chunk), -2, 0)  # [n, ..., c]
  body_scores = jax.checkpoint(chunk_scores, prevent_cse=False) if remat else chunk_scores

  def body(acc, qw):
    return acc + body_scores(*qw), None

  return jax.lax.scan(body, init, (q_chunks, w_chunks))[0]


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array, valid: jax.Array, *, head_chunk: int,
                 precision=None) -> jax.Array:
  """I [b,t,s] fp32 = sum_h w[t,h] * d**-0.5 * relu(q[t,h] . k[s]); -inf where not valid.

  q [b,t,h,d], w [b,t,h] (fp32, already scaled by h**-0.5), k [b,s,d], valid [b,t,s] bool.
  Heads are scored `head_chunk` at a time (a lax.scan accumulating [b,t,s]) so at most
  [b,t,s,head_chunk] is live, never [b,t,s,h]. A head count that `head_chunk` does not divide
  is padded with zero-weight heads (they add exactly 0). Each chunk is rematerialized in the
  backward pass, so the gradient does not store the [b,t,s,h] relu pattern either.
  """
  b, t, h, d = q.shape
  qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
  wf = w.astype(jnp.float32) * d ** -0.5  # [b,t,h]

  def chunk_scores(q_c, w_c):  # q_c [b,t,c,d], w_c [b,t,c] -> [b,t,s]
    logits = jnp.einsum("btcd,bsd->btcs", q_c, kf, precision=precision)  # [b,t,c,s]
    return jnp.einsum("btcs,btc->bts", jax.nn.relu(logits), w_c, precision=precision)

  scores = _over_head_chunks(qf, wf, chunk_scores, jnp.zeros((b, t, k.shape[1]), jnp.float32), head_chunk, True)
  return jnp.where(valid, scores, -jnp.inf)


def row_index_scores(q: jax.Array, w: jax.Array, k: jax.Array, *, head_chunk: int, precision=None) -> jax.Array:
  """index_scores' sum for one row, unmasked: q [t,h,d], w [t,h] (as index_scores'), k [s,d] -> [t,s] fp32.

  The same arithmetic on 2-D operands: the logits are one [t*c, d] x [d, s] matmul with no batch
  dimension. XLA:CPU runs index_scores' batched dot_general 1.8x slower at t = 1 even for one row
  (a 64K-key decode scoring in blocks, 2026-12-05): the paged key source (inference/paged_cache.PagedKeys)
  scores each row's blocks through this. No rematerialization (inference only).

  q and k both bf16 (an fp8 cache's e4m3 codes against fp8 queries: paged_decode.fp8_scored_queries): the
  logits are a bf16 x bf16 dot accumulated in fp32, not the fp32 dot of the same values: a product of two
  bf16 values is exact in fp32, so the two differ only in the order of the fp32 sums (DeepGEMM's fp8 MQA
  logits' arithmetic), and XLA:CPU runs it 1.9x faster on a CPU with avx512_bf16 (docs/kernels.md, On the
  CPU). Any other dtypes: both operands as fp32."""
  d = q.shape[-1]
  dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16 else jnp.float32
  kf = k.astype(dtype)

  def chunk_scores(q_c, w_c):  # q_c [t,c,d], w_c [t,c] -> [t,s]
    logits = jnp.einsum("tcd,sd->tcs", q_c, kf, precision=precision,
                        preferred_element_type=jnp.float32)  # [t,c,s] fp32
    return jnp.einsum("tcs,tc->ts", jax.nn.relu(logits), w_c, precision=precision)

  init = jnp.zeros((q.shape[0], k.shape[0]), jnp.float32)
  return _over_head_chunks(q.astype(dtype), w.astype(jnp.float32) * d ** -0.5, chunk_scores, init,
                           head_chunk, False)


def gathered_index_scores(q: jax.Array, w: jax.Array, k: jax.Array, idx: jax.Array, idx_valid: jax.Array, *,
                          precision=None) -> jax.Array:
  """The indexer scores of the selected keys only: I[t, idx] [b,t,k'] fp32, -inf on invalid slots.

  q [b,t,H,d], w [b,t,H] (fp32, times H**-0.5), k [b,s,d] as for indexer.index_scores; the same
  sum_h w * d**-0.5 * relu(q . k), over k' gathered keys instead of all s.
  """
  d = q.shape[-1]
  k_g = gather_rows(k.astype(jnp.float32), idx)  # [b,t,k',d]
  logits = jnp.einsum("bthd,btkd->bthk", q.astype(jnp.float32), k_g, precision=precision)  # [b,t,H,k']
  scores = jnp.einsum("bthk,bth->btk", jax.nn.relu(logits), w.astype(jnp.float32) * d ** -0.5,
                      precision=precision)  # [b,t,k']
  return jnp.where(idx_valid, scores, -jnp.inf)


def indexer_kl_loss(attn_probs: jax.Array, scores: jax.Array, support: jax.Array) -> jax.Array:
  """L_I = mean over query tokens of KL(p_t || softmax(I_t)), both restricted to `support`.

  attn_probs [b,h,t,s] (the main attention's probabilities), scores [b,t,s] (indexer I),
  support [b,t,s] bool: the keys the KL runs over (all valid keys in the dense warm-up, the
  selected set S_t in the sparse stage). p_t = sum_h attn_probs, renormalized (L1) over the
  support, and detached: the loss trains only the indexer. softmax(I_t) is taken over the
  support too. Reduction: the mean over (b,t) of the queries whose support is non-empty
  (padding queries count for nothing), so the loss does not grow with batch or length.
  Returns a scalar f32; 0 when no query has a support.
  """
  p = jnp.sum(jax.lax.stop_gradient(attn_probs).astype(jnp.float32), axis=1)  # [b,t,s]
  p = jnp.where(support, p, 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)  # L1 over the support
  logq = jax.nn.log_softmax(jnp.where(support, scores.astype(jnp.float32), -1e30), axis=-1)  # [b,t,s]
  pos = support & (p > 0)
  kl_terms = jnp.where(pos, p * (jnp.log(jnp.where(pos, p, 1.0)) - jnp.where(pos, logq, 0.0)), 0.0)
  kl_t = jnp.sum(kl_terms, axis=-1)  # [b,t]
  has = jnp.any(support, axis=-1)  # [b,t]
  return jnp.sum(jnp.where(has, kl_t, 0.0)) / jnp.maximum(jnp.sum(has), 1)
