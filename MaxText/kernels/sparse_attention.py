"""Gather-based DeepSeek Sparse Attention for MLA: attention in O(t*k), not O(t*s).

The mask path (attention_mla.MLA.attend) turns the indexer's selection into a [b,t,s] mask and
still runs dense attention over all s keys. Here each query reads only its k selected keys, in
the ABSORBED form over the latent cache, as FlashMLA's sparse kernels do:

    w_uk, w_uv = split(wkv_b)                                 [c,h,nope], [c,h,v]
    q_lat  = q_nope . w_uk                                    [b,t,h,c]     absorb_q
    logits = (q_lat . c_kv[idx] + q_pe . k_pe[idx]) * scale   [b,h,t,k]     gather_attend
    o_lat  = softmax(logits) . c_kv[idx]                      [b,t,h,c]
    out    = o_lat . w_uv                                     [b,t,h,v]     unabsorb_out

Since k_nope = c_kv . w_uk and v = c_kv . w_uv, this is the mask path's function in exact
arithmetic. All h heads share one gathered row of c+r latent values per key (multi-query
style), so the gather moves k*(c+r) values per query, not k*h*(nope+v); the price is
h*(2c+r) multiply-adds per (query, key) instead of h*(nope+r+v) (3.4x at DeepSeek's dims).

Training and prefill run `sparse_mla_attention`: a lax.map over blocks of
`sparse_attention_query_block` queries. Each block scores its queries against all s keys with
the lightning indexer ([b,blk,s], heads chunked as in indexer.index_scores), selects top-k
indices, gathers, attends and un-absorbs. Memory: O(blk*s + blk*k*(c+r)) per block, and
O(t*(k + h*(nope+r))) kept for the backward pass (spec.block_remat, sparse_attention_block_remat: a block's
absorbed queries and attention are recomputed from its q_nope, q_pe and indices; without it O(t*(k + h*(2c+r))),
at 128 heads and 8K tokens 4.3 GiB of f32 on XLA:CPU): never [t,s] for attention, never [t,s,h] for the indexer;
linear in t. Blocks are strided (block j holds queries j, j+n, j+2n, ...), so a
sequence sharded over the `context` mesh axis keeps each block spread over all devices and
each device runs its own queries (the keys are all-gathered: a query may select any key).

Gradients: a custom VJP per block (_attend_block), flash-attention style. The backward pass
recomputes each query's gather and softmax, and scatter-adds the keys' cotangent in place into
one [b,s,c+r] carry. Plain autodiff would keep every query's gathered keys for the backward
pass (O(t*k*(c+r)): 16x the whole KV at k = s/16) or, rematerialized, transpose each query's
gather into a fresh zero [b,s,c+r] cotangent: O(s) work per query, O(t*s) in all.
backend.py's gather_attention "pallas" / "pallas_dma" runs a block's attention and its VJP in the Mosaic kernels
of sparse_mla_kernel.py instead (no [b,h,blk,k] logits in HBM; forced only until timed on a TPU).
On CPU (query_loop "loop" in backend.py) a block's attention loops over its queries with 2-D
matmuls, so each query's gathered keys stay in cache between its score and output matmuls: faster
on CPU than one block-wide batched gather ("vmap"), which other backends run
(benchmarks/sparse_attention.py; docs/measured_choices.md).

Selection (the same semantics as the mask path, see selection.py):
  exact    topk_threshold + generate_mask(exact_topk=True): exactly min(k, #valid) keys, ties at
           the k-th value lowest position first (lax.top_k's set), compacted to indices.
  approx   select_topk(approx=True): the approximate index set, as the mask path with
           indexer_mask_exact_topk=true.
  A -inf/NaN score is never selected; slots past a row's valid keys are marked invalid and get
  probability 0, so a query with <= k valid keys attends to all of them (dense causal attention).
  The gather path always selects exactly min(k, #valid) keys: with indexer_mask_exact_topk=false
  the mask path takes every key >= the k-th value (more than k under ties, or under an
  approximate cutoff) and the two agree only where no such extra key exists.

The indexer loss over the selected sets (spec.with_kl: a stage that attends to the selection
and trains the indexer, layers/indexer.py STAGES) is computed per block from the attention
probabilities of the selected keys and their indexer scores, recomputed from the gathered
indexer keys, so its gradient costs O(t*k), not O(t*s). A stage with dense attention never
comes here: MLA runs the mask path there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.kernels import backend
from MaxText.kernels.index_scores import gathered_index_scores, index_scores, indexer_kl_loss
from MaxText.kernels.low_rank import LowRank, absorbed_out_delta, absorbed_q_delta
from MaxText.kernels.masks import attention_validity
from MaxText.kernels.selection import additive_mask
from MaxText.kernels.sparse_mla_kernel import GATHER_OF_WAY, sparse_mla_attend
from MaxText.kernels.topk_indices import gather_rows, topk_indices
from MaxText.runtime.sharding import constrain, kernel_mesh, logical_to_spec

_PAD_POSITION = jnp.iinfo(jnp.int32).min  # padding queries' position: no key is <= it
SELECTION_NAME = "sparse_selection"  # a block's idx, ok and p_heads: what a layer remat policy may save (decoder.py
# save_attention_selection), so that its backward pass re-runs no block's selection or attention forward


# ----------------------------------------------------------------------------- absorbed MLA pieces


def _split_wkv_b(wkv_b_kernel: jax.Array, num_heads: int, nope: int, v: int) -> tuple[jax.Array, jax.Array]:
  """wkv_b kernel [c, h*(nope+v)] -> w_uk [c,h,nope], w_uv [c,h,v] (MLA.expand_kv's split)."""
  c = wkv_b_kernel.shape[0]
  w = wkv_b_kernel.reshape(c, num_heads, nope + v)  # [c,h,nope+v]
  return w[..., :nope], w[..., nope:]


def _plus(y: jax.Array, delta: jax.Array | None, dtype) -> jax.Array:
  """y (fp32 when delta is given) + delta (fp32), rounded to dtype once (kernels/low_rank.py: why)."""
  return y if delta is None else (y + delta).astype(dtype)


def absorb_q(q_nope: jax.Array, wkv_b_kernel: jax.Array, num_heads: int, nope: int, v: int, *,
             precision=None, delta: jax.Array | None = None) -> jax.Array:
  """q_nope [b,t,h,nope] -> q_lat [b,t,h,c] = q_nope . w_uk, so q_lat . c_kv = q_nope . k_nope. delta [b,t,h,c]
  fp32: wkv_b's low-rank term (low_rank.absorbed_q_delta), added to the fp32 product before its one rounding."""
  w_uk, _ = _split_wkv_b(wkv_b_kernel, num_heads, nope, v)  # [c,h,nope]
  out = None if delta is None else jnp.float32
  q_lat = jnp.einsum("bthd,chd->bthc", q_nope, w_uk.astype(q_nope.dtype), precision=precision,
                     preferred_element_type=out)  # [b,t,h,c]
  return _plus(q_lat, delta, q_nope.dtype)


def unabsorb_out(o_lat: jax.Array, wkv_b_kernel: jax.Array, num_heads: int, nope: int, v: int, *,
                 precision=None, delta: jax.Array | None = None) -> jax.Array:
  """o_lat [b,t,h,c] (probabilities . c_kv) -> out [b,t,h,v] = o_lat . w_uv (= probabilities . v). delta
  [b,t,h,v] fp32: wkv_b's low-rank term (low_rank.absorbed_out_delta), added before the one rounding."""
  _, w_uv = _split_wkv_b(wkv_b_kernel, num_heads, nope, v)  # [c,h,v]
  out = None if delta is None else jnp.float32
  o = jnp.einsum("bthc,chv->bthv", o_lat, w_uv.astype(o_lat.dtype), precision=precision,
                 preferred_element_type=out)  # [b,t,h,v]
  return _plus(o, delta, o_lat.dtype)


def _masked_softmax(logits: jax.Array, valid: jax.Array) -> jax.Array:
  """Softmax over the last (slot) axis of fp32 logits where `valid` (broadcastable bool) marks the
  slots, as MLA.attend: a finite large negative on invalid slots, and all-zero probabilities for a
  row with no valid slot (not a uniform softmax)."""
  probs = jax.nn.softmax(logits + additive_mask(valid, jnp.float32), axis=-1)
  return jnp.where(jnp.any(valid, axis=-1, keepdims=True), probs, 0.0)


def gather_attend(q_lat: jax.Array, q_pe: jax.Array, c_kv: jax.Array, k_pe: jax.Array, idx: jax.Array | None,
                  idx_valid: jax.Array, scale: float, *, precision=None) -> tuple[jax.Array, jax.Array]:
  """Attention of each query over its k gathered latent keys (absorbed MLA), e.g. one decode step.

  q_lat [b,t,h,c] (absorb_q), q_pe [b,t,h,r] (RoPE'd), c_kv [b,s,c], k_pe [b,s,r] (a cache or
  the whole sequence), idx [b,t,k] int32 key positions in [0, s) (None: c_kv / k_pe are already each query's
  k rows in order, [b, t*k, .]: no gather), idx_valid [b,t,k] bool (False
  slots are masked out), scale the softmax scale -> o_lat [b,t,h,c] (in q_lat's dtype;
  unabsorb_out maps it to [b,t,h,v]) and probs [b,h,t,k] fp32. A row with no valid slot gives
  o_lat 0 and probs 0. Work and memory O(t*k*(c+r) + t*h*k), independent of s. Plain autodiff
  (sparse_mla_attention has the memory-lean VJP for training).
  """
  f32, dt = jnp.float32, q_lat.dtype
  if idx is None:  # rows given in order: a reshape (an identity gather copied them: 67 MB f32 at 16 x 2048 x 512)
    rows = lambda a: a.reshape(*idx_valid.shape, a.shape[-1])  # [b,t*k,e] -> [b,t,k,e]
  else:
    rows = lambda a: gather_rows(a, idx)  # [b,t,k,e]
  c_g = rows(c_kv).astype(dt)  # [b,t,k,c]; cast after the gather: O(k), not O(s)
  pe_g = rows(k_pe).astype(dt)  # [b,t,k,r]
  logits = (jnp.einsum("bthc,btkc->bhtk", q_lat, c_g, precision=precision, preferred_element_type=f32)
            + jnp.einsum("bthr,btkr->bhtk", q_pe.astype(dt), pe_g, precision=precision,
                         preferred_element_type=f32))  # [b,h,t,k]
  probs = _masked_softmax(logits * scale, idx_valid[:, None])  # [b,h,t,k] fp32
  o_lat = jnp.einsum("bhtk,btkc->bthc", probs.astype(dt), c_g, precision=precision)  # [b,t,h,c]
  return o_lat, probs


# ----------------------------------------------------------------------------- one block, custom VJP
#
# The math is written for ONE query (2-D matmuls); a block runs it either as a loop over its
# queries (CPU: the query's gathered keys stay in cache between its score and output matmuls) or
# vmapped over the whole block (other backends: one large batched gather and matmul).


def _query_probs(q: jax.Array, kv: jax.Array, idx: jax.Array, ok: jax.Array, scale: float, precision
                 ) -> tuple[jax.Array, jax.Array]:
  """One query: q [h,e] = [q_lat | q_pe], kv [s,e] = [c_kv | k_pe], idx/ok [k] -> its gathered keys
  kv_g [k,e] and probs [h,k] fp32 (one gather of c+r values per key, one score matmul)."""
  kv_g = jnp.take(kv, idx, axis=0, mode="clip")  # [k,e]
  logits = jnp.einsum("he,ke->hk", q, kv_g, precision=precision, preferred_element_type=jnp.float32)  # [h,k]
  return kv_g, _masked_softmax(logits * scale, ok[None, :])


def _query_fwd(q, kv, idx, ok, scale, c, precision):
  """One query -> o_lat [h,c] and p_heads [k] (probabilities summed over heads). The output matmul
  runs over all e = c+r columns and drops the r rotary ones (1/9 extra work at DeepSeek's dims)
  rather than slice the gathered keys."""
  kv_g, probs = _query_probs(q, kv, idx, ok, scale, precision)
  o = jnp.einsum("hk,ke->he", probs.astype(q.dtype), kv_g, precision=precision)  # [h,e]
  return o[:, :c], jnp.sum(probs, axis=0)


def _query_bwd(q, kv, idx, ok, do, d, scale, precision):
  """One query's softmax backward, flash-attention style: recompute the probabilities; with
  do [h,e] (d o_lat, zero on the rotary columns) and d [h] = do . o_lat -> dq [h,e], dkv_g [k,e]."""
  f32 = jnp.float32
  kv_g, probs = _query_probs(q, kv, idx, ok, scale, precision)  # [k,e], [h,k]
  kv_g = kv_g.astype(f32)
  dp = jnp.einsum("he,ke->hk", do, kv_g, precision=precision)  # [h,k]
  ds = probs * (dp - d[:, None]) * scale  # [h,k]: d(q . kv_g)
  dq = jnp.einsum("hk,ke->he", ds, kv_g, precision=precision)  # [h,e]
  # d kv_g = ds^T q + probs^T do as ONE dot over 2h ([ds | probs] with [q | do]): the same products, summed in
  # fp32. Compiled for a v5e (256 queries x 2048 of 32K, vmapped), two dots wrote [B,k,e] f32 twice (the second
  # adding the first) in the MXU's [B,e,k] order, then a 1.2 GB copy into the scatter's rows; one dot writes it
  # once, in row order: XLA's estimate 23.3 -> 15.1 ms a block forward + backward, temp 4.63 -> 3.04 GiB.
  dkv_g = jnp.einsum("hk,he->ke", jnp.concatenate([ds, probs]), jnp.concatenate([q.astype(f32), do]),
                     precision=precision)  # [k,e]; 0 on invalid slots
  return dq, dkv_g


def _per_sequence(fn, *arrays: jax.Array):
  """fn over each sequence of a batch: arrays [b,...] -> fn(a[i] ...) stacked [b,...]. With b = 1
  (long-context prefill) no vmap, so fn's matmuls stay 2-D."""
  if arrays[0].shape[0] == 1:
    return jax.tree.map(lambda o: o[None], fn(*(a[0] for a in arrays)))
  return jax.vmap(fn)(*arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attend_block(q: jax.Array, kv: jax.Array, idx: jax.Array, ok: jax.Array, scale: float, c: int,
                  loop: bool, precision) -> tuple[jax.Array, jax.Array]:
  """One query block's attention over its selected keys (absorbed MLA), with a flash-style VJP.

  q [b,B,h,e] = [q_lat | q_pe], kv [b,s,e] = [c_kv | k_pe], idx/ok [b,B,k] -> o_lat [b,B,h,c] and
  p_heads [b,B,k] fp32, the probabilities summed over heads (for the indexer KL; no gradient flows
  back through it). loop: one query at a time (CPU), else vmapped over the block.
  """
  return _attend_block_fwd(q, kv, idx, ok, scale, c, loop, precision)[0]


def _attend_block_fwd(q, kv, idx, ok, scale, c, loop, precision):
  one = functools.partial(_query_fwd, scale=scale, c=c, precision=precision)

  def sequence(q_b, kv_b, idx_b, ok_b):  # [B,h,e], [s,e], [B,k], [B,k] -> [B,h,c], [B,k]
    if loop:
      return lax.map(lambda a: one(a[0], kv_b, a[1], a[2]), (q_b, idx_b, ok_b))
    return jax.vmap(one, in_axes=(0, None, 0, 0))(q_b, kv_b, idx_b, ok_b)

  o_lat, p_heads = _per_sequence(sequence, q, kv, idx, ok)  # [b,B,h,c], [b,B,k]
  return (o_lat, p_heads), (q, kv, idx, ok, o_lat)


def _attend_block_bwd(scale, c, loop, precision, res, cts):
  """The keys' cotangent [b,s,e] gathers each query's gathered-key cotangent by a scatter-add: in
  place into the loop's carry (CPU), or in one scatter from the vmapped block.

  Under a mesh of several devices (sharding.kernel_mesh) it runs per shard in a jax.shard_map: a device's
  queries (rows over activation_batch, the block over activation_length) and heads (activation_heads) give a
  partial [b,s,e] (their heads' and queries' share), summed over the head and query axes by one psum AFTER the
  scatter-add. Left to XLA, the head sum is all-reduced where the head contraction makes it, on the gathered
  [B*k,e] rows: 16 x 1.2 GB a layer for the 671B's 4K step on tensor 2 (train_compile's collective_traffic)
  against 16 x 9.4 MB here."""
  q, kv, idx, ok, o_lat = res
  do_lat = cts[0].astype(jnp.float32)  # [b,B,h,c]; p_heads carries no gradient
  e = q.shape[-1]
  do = jnp.pad(do_lat, [(0, 0)] * 3 + [(0, e - c)])  # [b,B,h,e]: zero on the rotary columns
  d = jnp.sum(do_lat * o_lat.astype(jnp.float32), axis=-1)  # [b,B,h] = sum_k p * dp
  local = functools.partial(_attend_block_bwd_local, scale=scale, loop=loop, precision=precision)
  active = kernel_mesh()
  if active is None:
    dq, dkv = local(q, kv, idx, ok, do, d)
  else:
    mesh, rules = active
    qs = logical_to_spec(("activation_batch", "activation_length", "activation_heads", None), rules, mesh, q.shape)
    rows, keys = P(qs[0], qs[1], None), P(qs[0], None, None)  # idx/ok [b,B,k]; kv and dkv [b,s,e]
    summed = tuple(a for part in (qs[1], qs[2]) for a in ((part,) if isinstance(part, str) else part or ()))

    def shard(q, kv, idx, ok, do, d):
      dq, dkv = local(q, kv, idx, ok, do, d)  # dkv [b,s,e]: this device's queries' and heads' share
      return dq, lax.psum(dkv, summed) if summed else dkv  # [b,s,e] whole

    dq, dkv = jax.shard_map(shard, mesh=mesh, in_specs=(qs, keys, rows, rows, qs, P(*qs[:3])),
                            out_specs=(qs, keys), check_vma=False)(q, kv, idx, ok, do, d)
  return dq.astype(q.dtype), dkv.astype(kv.dtype), None, None


def _attend_block_bwd_local(q, kv, idx, ok, do, d, *, scale, loop, precision):
  """_attend_block_bwd on the arrays as they are: q/do [b,B,h,e], kv [b,s,e], idx/ok [b,B,k], d [b,B,h] -> dq
  [b,B,h,e] f32, dkv [b,s,e] f32."""
  e = q.shape[-1]
  one = functools.partial(_query_bwd, scale=scale, precision=precision)

  def sequence(q_b, kv_b, idx_b, ok_b, do_b, d_b):  # [B,h,e], [s,e], [B,k] x2, [B,h,e], [B,h]
    if loop:
      def step(dkv, a):
        dq1, dkv_g = one(a[0], kv_b, *a[1:])  # [h,e], [k,e]
        return dkv.at[a[1]].add(dkv_g), dq1

      dkv, dq = lax.scan(step, jnp.zeros(kv_b.shape, jnp.float32), (q_b, idx_b, ok_b, do_b, d_b))
      return dq, dkv  # [B,h,e], [s,e]
    dq, dkv_g = jax.vmap(one, in_axes=(0, None, 0, 0, 0, 0))(q_b, kv_b, idx_b, ok_b, do_b, d_b)
    return dq, jnp.zeros(kv_b.shape, jnp.float32).at[idx_b.reshape(-1)].add(dkv_g.reshape(-1, e))

  return _per_sequence(sequence, q, kv, idx, ok, do, d)  # [b,B,h,e], [b,s,e]


_attend_block.defvjp(_attend_block_fwd, _attend_block_bwd)


def attend_block(q: jax.Array, kv: jax.Array, idx: jax.Array, ok: jax.Array, scale: float, c: int, *,
                 loop: bool = False, precision=None, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """One query block's attention over its selected rows, by backend.py's gather_attention (read when traced):
  "xla" _attend_block (loop / precision as there), "pallas" / "pallas_dma" sparse_mla_kernel.sparse_mla_attend
  (its rows gathered by XLA / DMA'd by the kernel; `block` its slots a grid step, None: BLOCK_SLOTS). q [b,B,h,e], kv [b,s,e], idx/ok [b,B,k] -> o_lat [b,B,h,c],
  p_heads [b,B,k] fp32; differentiable in q and kv (p_heads carries no gradient)."""
  way = backend.choice("gather_attention")
  if way == "xla":
    return _attend_block(q, kv, idx, ok, scale, c, loop, precision)
  return sparse_mla_attend(q, kv, idx, ok, scale, c, gather=GATHER_OF_WAY[way], block=block)


# ----------------------------------------------------------------------------- the blocked driver


def _blocks(a: jax.Array, n: int, blk: int, fill) -> jax.Array:
  """[b,t,...] -> [n,b,blk,...], t padded to n*blk with `fill`; block j holds rows j, j+n, j+2n..."""
  b, t = a.shape[:2]
  pad = n * blk - t
  if pad:
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
  a = jnp.moveaxis(a.reshape(b, blk, n, *a.shape[2:]), 2, 0)  # [n,b,blk,...]
  return constrain(a, (None, "activation_batch", "activation_length") + (None,) * (a.ndim - 3))


def _unblocks(a: jax.Array, t: int) -> jax.Array:
  """[n,b,blk,...] -> [b,t,...], the inverse of _blocks (padding rows dropped)."""
  n, b, blk = a.shape[:3]
  a = jnp.moveaxis(a, 0, 2).reshape(b, n * blk, *a.shape[3:])[:, :t]  # [b,t,...]
  return constrain(a, ("activation_batch", "activation_length") + (None,) * (a.ndim - 2))


class SparseQueries(NamedTuple):
  """This call's queries, MLA's and the indexer's, and where they sit in their sequences."""
  q_nope: jax.Array  # [b,t,h,nope]
  q_pe: jax.Array  # [b,t,h,r], RoPE'd
  index_q: jax.Array  # [b,t,H,d], the indexer's queries (from detached inputs)
  index_w: jax.Array  # [b,t,H] fp32, the indexer's head weights (times H**-0.5)
  positions: jax.Array  # [b,t] original positions
  segments: jax.Array | None  # [b,t] (0 = padding); None = one segment, no padding


class SparseKeys(NamedTuple):
  """Every key those queries may select, in original order (context parallelism gathers them)."""
  c_kv: jax.Array  # [b,s,c], the MLA latent
  k_pe: jax.Array  # [b,s,r], the shared rotary key
  index_k: jax.Array  # [b,s,d], the indexer's key
  positions: jax.Array  # [b,s]
  segments: jax.Array | None  # [b,s], None exactly when the queries' segments are None


class SparseSpec(NamedTuple):
  """The static shape of one call: MLA's dims, the selection, blocking and precision."""
  num_heads: int
  nope: int
  v: int
  scale: float  # the softmax scale
  topk: int
  query_block: int  # queries per block of the lax.map
  head_chunk: int  # indexer heads scored at a time (index_scores)
  approx: bool = False  # approximate top-k (selection.select_topk) instead of exact
  recall_target: float = 0.95
  with_kl: bool = False  # compute the sparse stage's indexer KL over the selected sets
  precision: object = None
  query_loop: bool | None = None  # one query at a time inside a block (None: backend.py's query_loop)
  block_remat: bool = False  # recompute a block's attention in the backward pass from its queries and indices (sparse_attention_block_remat)


class SparseOutput(NamedTuple):
  out: jax.Array  # [b,t,h,v] in q_nope's dtype
  idx: jax.Array  # [b,t,k'] int32 selected key positions, k' = min(topk, s)
  idx_valid: jax.Array  # [b,t,k'] bool
  indexer_loss: jax.Array  # [] f32: the KL over the selected sets (0 unless spec.with_kl)


def sparse_mla_attention(queries: SparseQueries, keys: SparseKeys, wkv_b_kernel: jax.Array,
                         spec: SparseSpec, wkv_b_lora: LowRank | None = None) -> SparseOutput:
  """Blocked gather-based sparse MLA (training and prefill): indexer scores, top-k, attention.

  wkv_b_kernel [c, h*(nope+v)] is MLA's up-projection (absorbed, see absorb_q); wkv_b_lora its adapter, kept
  apart (A [1,c,r], B [1,r,h*(nope+v)] holding alpha / r; kernels/low_rank.py), so the up-projection is
  W + A B in every query's absorb_q and unabsorb_out as in the mask path's Linear. Positions and
  segments decide which keys each query may see (masks.attention_validity). The KL is the mean
  over the queries that select any key.

  Per block of spec.query_block queries (t padded to whole blocks): scores [b,blk,s]
  (index_scores, heads in chunks of head_chunk), topk_indices, absorb_q, _attend_block (one
  query at a time if query_loop, else vmapped over the block; None = backend.py's choice), unabsorb_out.
  The attention sends no gradient into the indexer (the indices are integers); the KL reaches
  only the indexer's q, w and k.
  """
  q_nope, q_pe, index_q, index_w, q_pos, q_seg = queries
  c_kv, k_pe, index_k, kv_pos, kv_seg = keys
  num_heads, nope, v, scale, topk, query_block, head_chunk, approx, recall_target, with_kl, precision, \
      query_loop, block_remat = spec
  b, t = q_nope.shape[:2]
  c = c_kv.shape[-1]
  dt = q_nope.dtype
  n = -(-t // min(query_block, t))
  blk = -(-t // n)  # n blocks of blk >= t/n queries: fewer than n padding rows
  loop = backend.choice("query_loop") == "loop" if query_loop is None else query_loop
  if q_seg is None:  # padding rows must see no key: give every row a segment
    q_seg, kv_seg = jnp.ones_like(q_pos), jnp.ones_like(kv_pos)
  kv_cat = jnp.concatenate([c_kv.astype(dt), k_pe.astype(dt)], axis=-1)  # [b,s,c+r]
  kv_cat = constrain(kv_cat, ("activation_batch", None, None))  # every device needs every key
  index_k = constrain(index_k, ("activation_batch", None, None))  # [b,s,d]
  kv_pos = constrain(kv_pos, ("activation_batch", None))
  kv_seg = constrain(kv_seg, ("activation_batch", None))

  xs = (_blocks(q_nope, n, blk, 0), _blocks(q_pe, n, blk, 0), _blocks(index_q, n, blk, 0),
        _blocks(index_w, n, blk, 0), _blocks(q_pos, n, blk, _PAD_POSITION), _blocks(q_seg, n, blk, 0))

  def kl_of_block(p_heads, iq, iw, idx, ok):  # rematerialized: keeps no [b,blk,k',d] gathered keys
    g_scores = gathered_index_scores(iq, iw, index_k, idx, ok, precision=precision)  # [b,blk,k']
    rows_with_keys = jnp.sum(jnp.any(ok, axis=-1)).astype(jnp.float32)
    return indexer_kl_loss(p_heads[:, None], g_scores, ok) * rows_with_keys, rows_with_keys

  kl_of_block = jax.checkpoint(kl_of_block, prevent_cse=False)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def select(iq, iw, qpos, qseg):  # -> idx, ok [b,blk,k'] x2
    # Checkpointed: under differentiation inside an outer scan (scanned layers) JAX would otherwise
    # split `valid` into a separate loop and keep every block's [b,blk,s] mask, O(t*s) in all.
    valid = attention_validity(qpos, kv_pos, qseg, kv_seg)  # [b,blk,s]
    sg = lax.stop_gradient  # the selection carries no gradient: trace none through the scores
    scores = index_scores(sg(iq), sg(iw), sg(index_k), valid, head_chunk=head_chunk, precision=precision)
    scores = constrain(scores, ("activation_batch", "activation_length", None))  # [b,blk,s]
    return topk_indices(scores, topk, approx=approx, recall_target=recall_target)

  def attend(qn, qp, idx, ok):  # block_remat: the map keeps a block's queries, not its [b,blk,h,c+r] and o_lat
    dq = None if wkv_b_lora is None else absorbed_q_delta(qn, wkv_b_lora, nope, dt, precision)  # [b,blk,h,c] f32
    q_lat = absorb_q(qn, wkv_b_kernel, num_heads, nope, v, precision=precision, delta=dq)  # [b,blk,h,c]
    q_cat = jnp.concatenate([q_lat, qp.astype(dt)], axis=-1)  # [b,blk,h,c+r]
    o_lat, p_heads = attend_block(q_cat, kv_cat, idx, ok, scale, c, loop=loop, precision=precision)
    do = None if wkv_b_lora is None else absorbed_out_delta(o_lat, wkv_b_lora, nope, dt, precision)  # [b,blk,h,v]
    return unabsorb_out(o_lat, wkv_b_kernel, num_heads, nope, v, precision=precision, delta=do), p_heads  # [b,blk,h,v]

  if block_remat:
    attend = jax.checkpoint(attend)

  def block(xs_j):
    qn, qp, iq, iw, qpos, qseg = xs_j  # [b,blk,h,nope], [b,blk,h,r], [b,blk,H,d], [b,blk,H], [b,blk] x2
    idx, ok = checkpoint_name(select(iq, iw, qpos, qseg), SELECTION_NAME)  # [b,blk,k'] x2
    out, p_heads = attend(qn, qp, idx, ok)  # [b,blk,h,v], [b,blk,k']
    p_heads = checkpoint_name(p_heads, SELECTION_NAME)
    if with_kl:
      kl_sum, n_rows = kl_of_block(lax.stop_gradient(p_heads), iq, iw, idx, ok)
    else:
      kl_sum = n_rows = jnp.zeros((), jnp.float32)
    return out, idx, ok, kl_sum, n_rows

  out, idx, ok, kl_sum, n_rows = lax.map(block, xs)  # [n,b,blk,h,v], [n,b,blk,k'] x2, [n] x2
  kl = jnp.sum(kl_sum) / jnp.maximum(jnp.sum(n_rows), 1.0)
  return SparseOutput(_unblocks(out, t), _unblocks(idx, t), _unblocks(ok, t), kl)


__all__ = ["SparseQueries", "SparseKeys", "SparseSpec", "SparseOutput", "absorb_q", "unabsorb_out",
           "attend_block", "gather_attend", "sparse_mla_attention"]
