"""Absorbed MLA over a cache plus t new tokens: the pieces MLA.attend_cached is built from.

A step reads the cache (the entries of earlier tokens, S slots per row) and the t new tokens'
own entries, which are not in the cache yet: a separate program writes them after the step (one
program that both updated the cache in place and fed it to a matmul made XLA:CPU copy the whole
cache). So every read splices the new tokens' values into their slots start[b] .. start[b]+t-1:

    splice(old [b,...,S], new [b,...,t], start)        the values the slots will hold
    index_scores_spliced                               indexer scores [b,t,S] over cache + new keys
    select_spliced                                     the indexer's top-k [b,t,k], its score buffer
                                                       bounded in bytes (score_blocks)
    latent_attention_dense                             softmax over every valid slot   [b,t,h,c]
    latent_attention_blocks                            the same, the cache read a block of slots at a
                                                       time (online softmax; the paged pools' dense read)
    merge_selected                                     selected rows from cache or new entries

With the absorbed weights (sparse_attention.absorb_q / unabsorb_out) this is MLA's function of
the same tokens: tests/integration/test_decode.py holds it equal to the expanded layer.

The cached indexer keys come as a key source: an object with `slots` (S), `scores(q, w, pos, *,
head_chunk, precision)` -> [b,tq,S] fp32 (-inf at slots past each query's position) and `row(i)`
(the source of row i alone). `ContiguousKeys` scores a [b,S,d] array; the paged pools' source
(inference/paged_cache.PagedKeys) scores a page block of one row at a time where the pages lie. Both
compute each score with the same arithmetic (index_scores; PagedKeys through row_index_scores, the
same sum on 2-D operands), so they select alike.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.kernels.index_scores import index_scores


class Absorbed(NamedTuple):
  """wkv_b of one layer (or a stack: a leading L axis), split and laid out head-major.

  absorb_q / unabsorb_out take a [kv_lora, h*(nope+v)] kernel. Handed wkv_b itself at t = 1,
  XLA:CPU transposes its [c,h,d] blocks to head-major on every step (docs/measured_choices.md).
  So a decode engine keeps these head-major copies, and `key_kernel` / `value_kernel` hand those
  functions the [c, h*nope] and [c, h*v] kernels as transposed VIEWS of them, which XLA folds into
  the matmuls: the same functions, the same results bit for bit.
  """
  w_uk: jax.Array  # [(L,) h, kv_lora, nope]
  w_uv: jax.Array  # [(L,) h, v, kv_lora]


def absorbed_weights(wkv_b_kernel: jax.Array, num_heads: int, nope: int, v: int) -> Absorbed:
  """wkv_b kernel [(L,) c, h*(nope+v)] -> Absorbed (head-major copies)."""
  w = wkv_b_kernel.reshape(*wkv_b_kernel.shape[:-1], num_heads, nope + v)  # [(L,) c,h,nope+v]
  return Absorbed(jnp.swapaxes(w[..., :nope], -3, -2),  # [(L,) h,c,nope]
                  jnp.moveaxis(w[..., nope:], -3, -1))  # [(L,) h,v,c]


def key_kernel(a: Absorbed) -> jax.Array:
  """[h,c,nope] -> the [c, h*nope] kernel (a view), for absorb_q with v = 0."""
  h, c, nope = a.w_uk.shape
  return jnp.swapaxes(a.w_uk, 0, 1).reshape(c, h * nope)


def value_kernel(a: Absorbed) -> jax.Array:
  """[h,v,c] -> the [c, h*v] kernel (a view), for unabsorb_out with nope = 0."""
  h, v, c = a.w_uv.shape
  return jnp.transpose(a.w_uv, (2, 0, 1)).reshape(c, h * v)


def splice(old: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """old [b,...,S] (per cache slot), new [b,...,t] (per new token) -> [b,...,S] with slots
  start[b] .. start[b]+t-1 taken from new (those past S dropped): the values the slots will hold
  after the commit. Per row, new is written into old padded by t slots (so a window running past
  S is never moved back), then the padding cut: no index array of old's size is built."""
  s, t = old.shape[-1], new.shape[-1]
  if t == 1:  # a decode step: one select (the padded copy below wrote the 16-row 128K step's scores out again)
    slot = jnp.arange(s, dtype=jnp.int32) == start.astype(jnp.int32).reshape((-1,) + (1,) * (old.ndim - 1))
    return jnp.where(slot, new.astype(old.dtype), old)  # [b,...,S]

  def row(o, n, st):  # o [...,S], n [...,t], st scalar
    o = jnp.concatenate([o, jnp.zeros(o.shape[:-1] + (t,), o.dtype)], axis=-1)  # [...,S+t]
    return jax.lax.dynamic_update_slice(o, n.astype(o.dtype), (0,) * (o.ndim - 1) + (st,))[..., :s]

  return jax.vmap(row)(old, new, start.astype(jnp.int32))


def latent_attention_dense(q_abs: jax.Array, q_pe: jax.Array, c_old: jax.Array, pe_old: jax.Array,
                           c_new: jax.Array, pe_new: jax.Array, valid: jax.Array, start: jax.Array, scale: float,
                           precision=None) -> jax.Array:
  """Absorbed attention over every valid slot: q_abs [b,t,h,c], q_pe [b,t,h,r]; the cache's
  latents c_old [b,S,c], pe_old [b,S,r] and the new tokens' c_new [b,t,c], pe_new [b,t,r] (as
  stored) at slots start[b].. ; valid [b,t,S] -> o_lat [b,t,h,c]. fp32 softmax."""
  f32, dt = jnp.float32, q_abs.dtype
  c_old, pe_old, c_new, pe_new = (a.astype(dt) for a in (c_old, pe_old, c_new, pe_new))

  def scores(c, pe):  # -> [b,h,t,n]
    return (jnp.einsum("bthc,bsc->bhts", q_abs, c, precision=precision, preferred_element_type=f32)
            + jnp.einsum("bthr,bsr->bhts", q_pe, pe, precision=precision, preferred_element_type=f32))

  logits = splice(scores(c_old, pe_old), scores(c_new, pe_new), start)  # [b,h,t,S]
  probs = jax.nn.softmax(jnp.where(valid[:, None], logits * scale, -jnp.inf), axis=-1)  # every query sees itself
  t = q_abs.shape[1]
  slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [b,t] the new tokens' slots
  # A padded row runs past S (a wide step's row starting at a cached prefix): those tokens have no slot
  # and weigh 0 (the default fill is NaN, which the einsum below would spread to every query of the row).
  p_new = jnp.take_along_axis(probs, jnp.broadcast_to(slots[:, None, None, :], probs.shape[:3] + (t,)), axis=-1,
                              mode="fill", fill_value=0)  # [b,h,t,t]
  p_old = splice(probs, jnp.zeros_like(p_new), start)  # their mass goes through c_new instead
  return (jnp.einsum("bhts,bsc->bthc", p_old.astype(dt), c_old, precision=precision)
          + jnp.einsum("bhtn,bnc->bthc", p_new.astype(dt), c_new, precision=precision))  # [b,t,h,c]


def latent_attention_blocks(q_abs: jax.Array, q_pe: jax.Array, read_block: Callable, n_blocks: int, width: int,
                            c_new: jax.Array, pe_new: jax.Array, start: jax.Array, scale: float,
                            precision=None) -> jax.Array:
  """latent_attention_dense's function, the cache read a block of `width` slots at a time:
  read_block(i) -> (c [b,width,c], pe [b,width,r]) of slots i*width.. (as stored, any dtype), for
  i < n_blocks. Each query attends to the cached slots before its row's start[b] (the slots from
  start on are this step's new tokens') and to the new tokens c_new [b,t,c], pe_new [b,t,r] up to
  itself (positions consecutive from start). Online softmax in fp32 (a running max, sum and
  weighted latents [b,t,h,c]), so neither the [b,h,t,S] logits nor the [b,S,c] latents ever exist;
  equal to latent_attention_dense up to rounding. q_abs [b,t,h,c], q_pe [b,t,h,r] -> [b,t,h,c]."""
  f32, dt = jnp.float32, q_abs.dtype
  b, t, h, c = q_abs.shape

  def scores(cc, pe):  # [b,n,c], [b,n,r] -> [b,h,t,n] fp32, scaled
    return (jnp.einsum("bthc,bsc->bhts", q_abs, cc, precision=precision, preferred_element_type=f32)
            + jnp.einsum("bthr,bsr->bhts", q_pe, pe, precision=precision, preferred_element_type=f32)) * scale

  def update(carry, logits, cc):  # logits [b,h,t,n] (-inf: not seen), cc [b,n,c]
    m, l, acc = carry  # [b,h,t], [b,h,t], [b,t,h,c]
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))  # finite: m starts at a finite floor
    p = jnp.exp(logits - m_new[..., None])  # [b,h,t,n]
    alpha = jnp.exp(m - m_new)  # [b,h,t]
    acc = acc * jnp.swapaxes(alpha, 1, 2)[..., None] + jnp.einsum("bhtn,bnc->bthc", p.astype(dt), cc,
                                                                    precision=precision, preferred_element_type=f32)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc

  def block(i, carry):
    cc, pe = (a.astype(dt) for a in read_block(i))  # [b,width,c], [b,width,r]
    slot = i * width + jnp.arange(width, dtype=jnp.int32)  # [width]
    seen = (slot[None, :] < start[:, None])[:, None, None, :]  # [b,1,1,width]
    return update(carry, jnp.where(seen, scores(cc, pe), -jnp.inf), cc)

  floor = jnp.finfo(f32).min  # not -inf: exp(m - m_new) stays 0 or 1, never NaN, before any slot is seen
  carry = (jnp.full((b, h, t), floor, f32), jnp.zeros((b, h, t), f32), jnp.zeros((b, t, h, c), f32))
  carry = jax.lax.fori_loop(0, n_blocks, block, carry) if n_blocks > 1 else block(0, carry)
  causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [t(query), t(new key)]
  c_new, pe_new = c_new.astype(dt), pe_new.astype(dt)
  _, l, acc = update(carry, jnp.where(causal, scores(c_new, pe_new), -jnp.inf), c_new)
  return (acc / jnp.swapaxes(l, 1, 2)[..., None]).astype(dt)  # [b,t,h,c]


class ContiguousKeys(NamedTuple):
  """A key source over cached indexer keys laid out per row: k [b,S,d] (any float dtype)."""
  k: jax.Array  # [b,S,d]

  @property
  def slots(self) -> int:
    return self.k.shape[1]

  def scores(self, q: jax.Array, w: jax.Array, pos: jax.Array, *, head_chunk: int, precision=None) -> jax.Array:
    """q [b,tq,h,d], w [b,tq,h], pos [b,tq] -> [b,tq,S] fp32, -inf at slots past pos."""
    valid = jnp.arange(self.slots, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [b,tq,S]
    return index_scores(q, w, self.k, valid, head_chunk=head_chunk, precision=precision)

  def row(self, i: jax.Array) -> "ContiguousKeys":
    return ContiguousKeys(jax.lax.dynamic_slice_in_dim(self.k, i, 1, axis=0))  # [1,S,d]


def index_scores_spliced(q_i: jax.Array, w_i: jax.Array, keys, k_new: jax.Array, pos: jax.Array,
                         start: jax.Array, head_chunk: int, precision=None, query_offset: jax.Array | int = 0
                         ) -> jax.Array:
  """Indexer scores [b,tq,S] fp32 of tq queries q_i [b,tq,h,d], w_i [b,tq,h] at positions pos
  [b,tq] (the new tokens query_offset .. query_offset+tq-1 of t): the cached keys of the key source
  `keys` (S slots), with the t new tokens' keys k_new [b,t,d] (as stored) spliced into their slots;
  -inf at slots past a query's position."""
  tq, t = q_i.shape[1], k_new.shape[1]
  valid = jnp.arange(keys.slots, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [b,tq,S]
  old = keys.scores(q_i, w_i, pos, head_chunk=head_chunk, precision=precision)  # [b,tq,S]
  causal = jnp.arange(t)[None, :] <= query_offset + jnp.arange(tq)[:, None]  # [tq,t]
  new = index_scores(q_i, w_i, k_new, jnp.broadcast_to(causal, (k_new.shape[0], tq, t)), head_chunk=head_chunk,
                     precision=precision)  # [b,tq,t]
  return jnp.where(valid, splice(old, new, start), -jnp.inf)


def score_blocks(b: int, t: int, h: int, s: int, head_chunk: int, max_bytes: int) -> tuple[int, int]:
  """(queries, heads) scored at once so that the [b, queries, heads, s] fp32 buffer of a block
  stays within max_bytes: as many of head_chunk heads as fit with all t queries, else one head
  and as many queries as fit (at least one: a budget below b*s*4 bytes is met by select_spliced
  scoring one row at a time)."""
  row = b * s * 4  # one query's scores for one head, over the rows
  heads = max(1, min(head_chunk, h, max_bytes // (row * t)))
  if heads * row * t <= max_bytes:
    return t, heads
  return max(1, max_bytes // row), 1


def select_spliced(q_i: jax.Array, w_i: jax.Array, keys, k_new: jax.Array, positions: jax.Array,
                   select: Callable, *, head_chunk: int, max_bytes: int, precision=None) -> tuple[jax.Array, ...]:
  """The indexer's selection for t new tokens per row at positions [b,t] (consecutive per row) over
  the key source `keys` (the cache's S slots: ContiguousKeys, paged_cache.PagedKeys) and their own
  keys k_new [b,t,d]: select(scores) of index_scores_spliced's scores [b,t,S] (valid: slot <= the
  query's position), computed in blocks of queries (a lax.map; score_blocks) so that no block's [b, tq, heads, S]
  fp32 score buffer exceeds max_bytes whatever t x S (neither the [b,t,S] scores of every query
  nor their [b,t,S] validity are ever live at once). select: scores [b,tq,S] -> arrays [b,tq,...]
  (e.g. topk_indices: idx, valid [b,tq,k]); each query's selection is its own, so blocks change
  nothing but the order of the head sum. Over budget with one query, rows go one at a time."""
  b, t, h, _ = q_i.shape
  s = keys.slots + t  # the cache's slots, and the new tokens' (splice pads by them)
  if b > 1 and b * s * 4 > max_bytes:  # one query of every row is already too much: row by row
    def one_row(args):
      i, *rows = args
      out = select_spliced(rows[0][None], rows[1][None], keys.row(i), *(a[None] for a in rows[2:]), select,
                           head_chunk=head_chunk, max_bytes=max_bytes, precision=precision)
      return tuple(o[0] for o in out)
    return jax.lax.map(one_row, (jnp.arange(b, dtype=jnp.int32), q_i, w_i, k_new, positions))  # each [b,t,...]
  tq, heads = score_blocks(b, t, h, s, head_chunk, max_bytes)
  start = positions[:, 0]

  def scores(q, w, pos, first):  # tq queries [b,tq,h,d], [b,tq,h] at pos [b,tq], new tokens first.. of t
    return index_scores_spliced(q, w, keys, k_new, pos, start, heads, precision, query_offset=first)

  if tq >= t:
    return select(scores(q_i, w_i, positions, 0))
  n = -(-t // tq)
  pad = n * tq - t  # padding queries (position -1: no valid key), their selection dropped

  def blocks(a, fill=0):  # [b,t,...] -> [n,b,tq,...]
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    return jnp.moveaxis(a.reshape(b, n, tq, *a.shape[2:]), 1, 0)

  out = jax.lax.map(lambda a: select(scores(a[0], a[1], a[2], a[3] * tq)),
                    (blocks(q_i), blocks(w_i), blocks(positions, -1), jnp.arange(n)))  # each [n,b,tq,...]
  return tuple(jnp.moveaxis(o, 0, 1).reshape(b, n * tq, *o.shape[3:])[:, :t] for o in out)  # [b,t,...]


def merge_selected(c_sel: jax.Array, pe_sel: jax.Array, c_new: jax.Array, pe_new: jax.Array, flat_idx: jax.Array,
                   start: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """The selected rows: c_sel [b,n,c], pe_sel [b,n,r] as read from the cache at flat_idx [b,n]
  positions; where a position is one of this step's new tokens (start[b] .. start[b]+t-1) its row
  comes from c_new [b,t,c], pe_new [b,t,r] instead."""
  t = c_new.shape[1]
  j = flat_idx - start[:, None]  # [b,n]
  fresh = ((j >= 0) & (j < t))[..., None]
  if t == 1:  # a decode step: the new row broadcast into the select (a take_along_axis wrote a [b,n,c] gather first)
    take = lambda a: a.astype(dtype)  # [b,1,c] broadcasts over n
  else:
    take = lambda a: jnp.take_along_axis(a.astype(dtype), jnp.clip(j, 0, t - 1)[..., None], axis=1)  # [b,n,c]
  return jnp.where(fresh, take(c_new), c_sel.astype(dtype)), jnp.where(fresh, take(pe_new), pe_sel.astype(dtype))


def merge_attention(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention over disjoint sets of keys merged: o [B,S,H,c] each set's (normalized) output, lse [B,S,H] the log
  of its softmax denominator (-inf: an empty set) -> (o [B,H,c] fp32, lse [B,H]) over their union (0 and -inf
  where every set is empty). The Triton MLA kernel's splits of the selected slots (paged_decode_gpu, split-KV)
  and a decode step's new token (merge_row)."""
  m = jnp.max(lse, axis=1, keepdims=True)  # [B,1,H]
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # all -inf: any finite shift (every weight is 0)
  w = jnp.exp(lse - m)  # [B,S,H]; an empty set 0
  den = jnp.sum(w, axis=1)  # [B,H]
  out = jnp.einsum("bsh,bshc->bhc", w, o.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  tiny = jnp.finfo(jnp.float32).tiny
  return out / jnp.maximum(den, tiny)[..., None], jnp.where(den > 0, m[:, 0] + jnp.log(jnp.maximum(den, tiny)), -jnp.inf)


def merge_row(o: jax.Array, lse: jax.Array, logit: jax.Array, row: jax.Array, take: jax.Array) -> jax.Array:
  """Attention over a set of keys merged with one more key: o [b,h,c] the set's output and lse [b,h] the log of
  its softmax denominator (-inf: the set is empty), the extra key's scaled logit [b,h] and value row [b,c],
  joining where take [b] -> the attention over both [b,h,c] fp32, the softmax over the union (0 where both are
  empty). A decode step's new token (its latent not in the pool until the step's write) joins the selected
  slots the pool kernel attended (paged_cache.attend_selected)."""
  new = jnp.where(take[:, None], logit.astype(jnp.float32), -jnp.inf)  # [b,h]
  rows = jnp.broadcast_to(row.astype(jnp.float32)[:, None, :], o.shape)  # [b,h,c]: the key's value for every head
  return merge_attention(jnp.stack([o.astype(jnp.float32), rows], axis=1), jnp.stack([lse, new], axis=1))[0]


__all__ = ["Absorbed", "absorbed_weights", "key_kernel", "value_kernel", "splice", "latent_attention_dense",
           "latent_attention_blocks",
           "ContiguousKeys", "index_scores_spliced", "score_blocks", "select_spliced", "merge_selected", "merge_row", "merge_attention"]
