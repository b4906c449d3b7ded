"""Causal attention over every valid key without the [b,h,t,s] tensors: JAX's Pallas TPU splash kernel.

MLA's mask path (layers/attention_mla.py `attend`) materializes f32 logits and probabilities [b,h,t,s]
in HBM. Where its support IS the validity mask (masks.attention_validity: causal, same segment, no
padding), the same attention is a flash-style kernel's causal mask with segment ids, and

    out = softmax(q . k * scale + mask) v        [b,t,h,v]   (padding queries: 0, as the mask path)

runs blockwise in VMEM (splash_attention: online softmax forward, its own VJP recomputing the blocks).
The indexer's KL target, the head-summed distribution sum_h p[b,h,t,s] (detached), is computed by
`head_summed_probs`: `head_chunk` heads at a time under stop_gradient, so only [b,c,t,s] is ever live and
nothing is kept for the backward pass. That is the XLA reference and the portable path: MLA.attend_flash takes
kernels/kl_target.py's Pallas kernel (no [h,t,s] in HBM), held to it by tests/unit/test_kl_target.py.

When splash's mask equals attention_validity (the caller, MLA.use_flash, decides; invariants):
  - the keys are the queries, in the same order (no context parallelism: its zig-zag order and its
    [t/cp, s] blocks are not splash's causal mask);
  - positions are the in-segment token order: within a segment, position = index + a constant (what
    the data pipelines' packing and train.py give), so k_pos <= q_pos <=> k_index <= q_index;
  - segment 0 (padding) keys are never visible to a real query (segments differ); padding queries see
    padding keys in splash, so their outputs are set to 0 here, and with them their gradients.
`interpret=True` (the default off a TPU) runs the kernel with Pallas' TPU interpreter on any backend:
tests/unit/test_flash_attention.py holds it to the mask path on the CPU. Block sizes: BLOCKS (docs/kernels.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from MaxText.kernels.backend import pallas_interpret
from MaxText.kernels.selection import additive_mask
from MaxText.runtime.sharding import kernel_mesh, logical_to_spec

BLOCKS = (512, 256, 128)  # splash's query / key block (forward and backward): the largest that divides t (512:
# MaxText's TPU default); splash needs a multiple of 128 lanes
KL_HEAD_CHUNK = 16  # heads per step of head_summed_probs: [b,16,t,s] f32 live (256 MiB at b=1, t=s=2048)


def supports_length(t: int) -> bool:
  """Whether splash runs over t tokens: t a multiple of one of BLOCKS."""
  return any(t % block == 0 for block in BLOCKS)


def _kernel(h: int, t: int, interpret: bool):
  """A splash kernel for [h,t,d] queries and keys under a causal mask. Built at every trace, never cached:
  it holds the mask's block tables as arrays, which a cache would leak from one trace into the next."""
  if not supports_length(t):
    raise ValueError(f"flash_attention: sequence length {t} must be a multiple of {BLOCKS[-1]} (splash's block)")
  block = next(b for b in BLOCKS if t % b == 0)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t)) for _ in range(h)])
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, *,
                    interpret: bool | None = None) -> jax.Array:
  """q [b,t,h,d], k [b,t,h,d], v [b,t,h,dv] (keys = the queries' tokens, same order), segment_ids [b,t] | None
  (0 = padding) -> out [b,t,h,dv] in v's dtype: softmax(q . k * scale) v over the causal, same-segment keys.

  Equals attend(..., attention_validity(pos, pos, seg, seg)) under the module's invariants; a padding query's
  output is 0. The scale goes onto q in f32 before the cast back to q's dtype (splash takes no scale).
  Under a mesh of several devices (sharding.logical_rules) the kernel runs per shard in a jax.shard_map: rows
  split as activation_batch, heads as activation_heads, the sequence whole (no collective: each shard's
  queries attend to its own rows' keys).
  """
  interpret = pallas_interpret(interpret)
  active = kernel_mesh()
  if active is None:
    return _flash_local(q, k, v, segment_ids, scale, interpret)
  mesh, rules = active
  spec = logical_to_spec(("activation_batch", None, "activation_heads", None), rules, mesh, q.shape)  # q, k, v, out
  local = functools.partial(_flash_local, scale=scale, interpret=interpret)
  if segment_ids is None:
    return jax.shard_map(lambda q_, k_, v_: local(q_, k_, v_, None), mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=spec, check_vma=False)(q, k, v)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(spec[0], None)), out_specs=spec,
                       check_vma=False)(q, k, v, segment_ids)


def _flash_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float,
                 interpret: bool) -> jax.Array:
  """flash_attention on one device's arrays (shapes as there)."""
  b, t, h, _ = q.shape
  kernel = _kernel(h, t, interpret)
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (qs, k, v))  # [b,h,t,d], [b,h,t,d], [b,h,t,dv]
  if segment_ids is None:
    out = jax.vmap(kernel)(qh, kh, vh)  # [b,h,t,dv]
  else:
    seg = segment_ids.astype(jnp.int32)
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(q=s1, kv=s1)))(
        qh, kh, vh, seg)  # [b,h,t,dv]
  out = jnp.swapaxes(out, 1, 2)  # [b,t,h,dv]
  if segment_ids is not None:
    out = jnp.where((segment_ids != 0)[:, :, None, None], out, 0)  # padding queries: 0, as the mask path
  return out


def head_summed_probs(q: jax.Array, k: jax.Array, valid: jax.Array, scale: float, *, precision=None,
                      head_chunk: int = KL_HEAD_CHUNK) -> jax.Array:
  """sum_h softmax(q . k * scale + mask) [b,t,s] f32, detached: the indexer KL's target without [b,h,t,s].

  q [b,t,h,d], k [b,s,h,d] (the attention's, in its compute dtype), valid [b,t,s] bool. The same arithmetic
  as MLA.attend's probabilities (f32 logits of q, k; the additive mask; a row with no valid key: 0), summed
  `head_chunk` heads at a time (a lax.scan: [b,c,t,s] live). Forward only: the inputs are stop_gradient'ed.
  """
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  b, t, h, d = q.shape
  c = min(head_chunk, h)
  if h % c:
    raise ValueError(f"head_summed_probs: head_chunk {c} must divide the {h} heads")
  n = h // c
  q_chunks = jnp.moveaxis(q.reshape(b, t, n, c, d), 2, 0)  # [n,b,t,c,d]
  k_chunks = jnp.moveaxis(k.reshape(b, k.shape[1], n, c, d), 2, 0)  # [n,b,s,c,d]
  bias = additive_mask(valid, jnp.float32)[:, None]  # [b,1,t,s]

  def body(acc, qk):
    q_c, k_c = qk
    logits = jnp.einsum("btcd,bscd->bcts", q_c, k_c, precision=precision,
                        preferred_element_type=jnp.float32)  # [b,c,t,s]
    return acc + jnp.sum(jax.nn.softmax(logits * scale + bias, axis=-1), axis=1), None  # [b,t,s]

  p = jax.lax.scan(body, jnp.zeros(valid.shape, jnp.float32), (q_chunks, k_chunks))[0]  # [b,t,s]
  return jnp.where(jnp.any(valid, axis=-1, keepdims=True), p, 0.0)  # rows with no key: 0
