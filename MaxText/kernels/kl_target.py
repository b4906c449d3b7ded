"""The indexer KL's target sum_h softmax(q . k * scale + mask) [b,t,s] as a Pallas TPU kernel, no [h,t,s] in HBM.

flash_attention.head_summed_probs (XLA: `head_chunk` heads at a time, [b,c,t,s] f32 logits and probabilities
in HBM each step) is the reference and the portable path; where MLA's mask path runs in splash
(MLA.attend_flash, backend choice mask_attention "splash") its support is the validity mask of causal +
same segment + no padding, and the target is this kernel's:

  grid (row b, query block i, head h), h the innermost and sequential: the output block [bq, s] f32 stays in
  VMEM over the heads (zeroed at h = 0) and is written to HBM once. For each (b, i, h), with the head's keys
  [s, d] in VMEM:
    pass 1  for each key block j at or below the causal diagonal (blocks above it: skipped, their p is 0):
            x = q . k^T (f32 accumulation) * scale, -1e30 where not valid; the row max m_j and sum of exp
            online (flash's forward without V) -> lse [bq, 1]; e_j = exp(x - m_j) kept in a VMEM scratch;
    pass 2  p[:, j] += e_j * exp(m_j - lse) = exp(x - lse) for the same blocks: one exp an element in all,
            0 where not valid (no mask to recompute).
  valid = key index <= query index, same segment, key segment != 0; a padding query (segment 0) has no valid
  key: its row is 0, as head_summed_probs returns it.

Invariants (those of flash_attention, which MLA.use_flash checks): the keys are the queries in the same order,
positions the in-segment token order (so causal by position is causal by index). VMEM at bq 256, bk 512,
s 2048, d 192: the output block 2 MiB (two buffers), the exp scratch 2 MiB and its maxima 512 KiB, a head's
keys 1 MiB (d padded to 256 lanes; two buffers): ~9 MiB, under v5e's 16 MiB default scoped limit. The head sum of a row block goes to HBM once: 16 MiB at
b 1, t = s = 2048, against the XLA path's [16,t,s] logits and probabilities per chunk.

`interpret=True` (the default off a TPU) runs it with Pallas' TPU interpreter (tests/unit/test_kl_target.py
holds it to head_summed_probs on the CPU). Under a mesh of several devices the XLA path runs (heads sharded
over tensor would need a head-sum collective here; not measured). docs/kernels.md, the splash section.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from MaxText.kernels.backend import dot_precision, pallas_interpret
from MaxText.kernels.flash_attention import head_summed_probs
from MaxText.runtime.sharding import active_mesh

QUERY_BLOCK = 256  # rows of the output block [bq, s] resident over the heads
KEY_BLOCK = 512  # keys per logits block; both the largest that divides t (down to 128 lanes)
_BLOCKS = (512, 256, 128)
VMEM_LIMIT = 32 * 2**20  # ~9 MiB needed at the blocks above (module doc): headroom over v5e's 16 MiB default
_NEG = -1e30  # masked logits in pass 1: finite, so a padding row's max and sum stay finite (its p is 0 anyway)
_NT = (((1,), (1,)), ((), ()))  # dot_general: [m,d] x [n,d] -> [m,n]


def _block(n: int, largest: int) -> int:
  """The largest of _BLOCKS <= `largest` that divides n."""
  for block in _BLOCKS:
    if block <= largest and n % block == 0:
      return block
  raise ValueError(f"kl_target: sequence length {n} must be a multiple of {_BLOCKS[-1]}")


def _kernel(q_ref, k_ref, qseg_ref, kseg_ref, out_ref, e_ref, mb_ref, m_ref, l_ref, *, scale: float, bq: int, bk: int):
  """One (row, query block, head) step: q_ref [bq, d], k_ref [s, d], qseg_ref [bq, 128] (lane-broadcast),
  kseg_ref [1, s], out_ref [bq, s] f32 (the head sum so far); f32 scratch: e_ref [s/bk, bq, bk] each key
  block's exp(x - m_j) with m_j the running max after it, mb_ref [s/bk, bq, 128] m_j, m_ref, l_ref [bq, 128] the
  online max and sum (lane-broadcast, as splash's)."""
  i, h = pl.program_id(1), pl.program_id(2)

  @pl.when(h == 0)
  def _():
    out_ref[...] = jnp.zeros_like(out_ref)

  n_blocks = e_ref.shape[0]
  # the key block holding the block's last query; blocks after it are above the diagonal (lax.div: Mosaic lowers
  # a traced // through sign, which needs a TPU's generation at lowering)
  last = jax.lax.div((i + 1) * bq - 1, bk)
  q = q_ref[...]  # [bq, d]
  q_idx = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)  # [bq, bk]
  q_seg = qseg_ref[:, 0:1]  # [bq, 1]

  def valid(j):  # [bq, bk] bool for key block j
    k_idx = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    k_seg = kseg_ref[:, j * bk:(j + 1) * bk]  # [1, bk]
    return (k_idx <= q_idx) & (k_seg == q_seg) & (k_seg != 0)

  m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  for j in range(n_blocks):  # pass 1: static key blocks (lane slices), those above the diagonal skipped
    @pl.when(j <= last)
    def _(j=j):
      logits = jax.lax.dot_general(q, k_ref[j * bk:(j + 1) * bk, :], _NT, preferred_element_type=jnp.float32,
                                   precision=dot_precision(q.dtype)) * scale  # [bq, bk]
      x = jnp.where(valid(j), logits, _NEG)
      m = m_ref[:, 0:1]  # [bq, 1]
      m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))  # [bq, 1]
      e = jnp.exp(x - m_new)  # [bq, bk]; 0 where not valid once the row has a valid key (1 before: m_new _NEG,
      # and pass 2's factor exp(_NEG - lse) is then 0)
      e_ref[j] = e  # pass 2 rescales it: one exp an element in all
      mb_ref[j] = jnp.broadcast_to(m_new, mb_ref.shape[1:])
      l_new = l_ref[:, 0:1] * jnp.exp(m - m_new) + jnp.sum(e, axis=1, keepdims=True)
      m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
      l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

  m, l = m_ref[:, 0:1], l_ref[:, 0:1]
  # [bq, 1]; l >= 1 (the max's own term). A row with no valid key (a padding query: m stays _NEG, its e 1) gets
  # +inf, so its p is e * exp(_NEG - inf) = 0; every other row's max is a real logit.
  lse = jnp.where(m > _NEG / 2, m + jnp.log(l), jnp.inf)

  for j in range(n_blocks):  # pass 2: this head's probabilities added to the head sum
    @pl.when(j <= last)
    def _(j=j):
      out_ref[:, j * bk:(j + 1) * bk] += e_ref[j] * jnp.exp(mb_ref[j][:, 0:1] - lse)  # [bq, bk]: exp(x - lse)


def head_summed_probs_kernel(q: jax.Array, k: jax.Array, segment_ids: jax.Array | None, scale: float, *,
                             query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK,
                             interpret: bool | None = None) -> jax.Array:
  """q [b,t,h,d], k [b,t,h,d] (keys = the queries' tokens, same order; bf16 or f32), segment_ids [b,t] | None
  (0 = padding) -> sum_h softmax [b,t,t] f32, detached: head_summed_probs(q, k, attention_validity(pos, pos,
  seg, seg), scale) under the module's invariants, within f32 rounding (another summation order)."""
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  b, t, h, d = q.shape
  bq, bk = _block(t, query_block), _block(t, key_block)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  qh, kh = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)  # [b,h,t,d]
  qseg = jnp.broadcast_to(seg[:, :, None], (b, t, 128))  # [b,t,128]: a query block's segments, lane-broadcast
  kseg = seg[:, None, :]  # [b,1,t]
  kernel = functools.partial(_kernel, scale=float(scale), bq=bq, bk=bk)
  return pl.pallas_call(
      kernel, grid=(b, t // bq, h),
      in_specs=[pl.BlockSpec((None, None, bq, d), lambda r, i, hd: (r, hd, i, 0)),
                pl.BlockSpec((None, None, t, d), lambda r, i, hd: (r, hd, 0, 0)),
                pl.BlockSpec((None, bq, 128), lambda r, i, hd: (r, i, 0)),
                pl.BlockSpec((None, 1, t), lambda r, i, hd: (r, 0, 0))],
      out_specs=pl.BlockSpec((None, bq, t), lambda r, i, hd: (r, i, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t, t), jnp.float32),
      scratch_shapes=[pltpu.VMEM((t // bk, bq, bk), jnp.float32), pltpu.VMEM((t // bk, bq, 128), jnp.float32),
                      pltpu.VMEM((bq, 128), jnp.float32), pltpu.VMEM((bq, 128), jnp.float32)],  # e, m_j, m, l
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT),
      interpret=pallas_interpret(interpret), name="kl_target_head_summed_probs")(qh, kh, qseg, kseg)


def flash_kl_target(q: jax.Array, k: jax.Array, valid: jax.Array, segment_ids: jax.Array | None, scale: float, *,
                    precision=None) -> jax.Array:
  """The KL target of MLA.attend_flash: the kernel on one device, head_summed_probs (XLA, over `valid`) under a
  mesh of several devices. Shapes as head_summed_probs_kernel; valid [b,t,t] the same support (the caller's)."""
  active = active_mesh()
  if active is not None and active[0].size > 1:
    return head_summed_probs(q, k, valid, scale, precision=precision)
  return head_summed_probs_kernel(q, k, segment_ids, scale)
