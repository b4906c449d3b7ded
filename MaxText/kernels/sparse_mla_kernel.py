"""Sparse MLA attention over each query's selected latent rows: Pallas (Mosaic TPU) kernels, forward and backward.

The gather path's attention (sparse_attention._attend_block, the XLA reference) as FlashMLA's sparse prefill kernel
organizes it, on a TPU. In the absorbed form all h heads share one selected latent row per key, kv [s, e] with
e = c + r (512 + 64), so per query token, over its k selected slots idx [k] (valid where ok [k]):

    logits [h,k] = q [h,e] . kv[idx] [k,e]^T * scale       MXU with M = h (128): one matmul a block of slots
    p      [h,k] = softmax over the valid slots              online over blocks of `block` slots, fp32
    o      [h,c] = p . kv[idx][:, :c]                        MXU, acc [h,c] fp32 in VMEM
    lse    [h]   = logsumexp of the valid logits             saved for the backward pass (0 where none valid)

Backward, flash-attention style (p recomputed from lse; nothing [h,k] kept):

    dp  [h,k] = do [h,c] . kv[idx][:, :c]^T;   ds = p * (dp - D) * scale,   D [h] = sum_c do * o   (XLA)
    dq  [h,e] = ds . kv[idx]                                accumulated over the slot blocks in VMEM
    dkv_g [k,e] = ds^T . q + [p^T . do | 0]                  per selection, each block written once
    d kv [s,e] = dkv_g scatter-added at idx                  by XLA, after the kernel: a key selected by several
                                                            queries (or twice) is summed, never raced
    p_heads [k] = sum_h p                                    a third kernel, for the indexer's KL (dropped
                                                            unused: a separate call, so XLA removes it)

Never in HBM: the [h, t, k] logits, probabilities or their cotangents (the XLA path writes and reads each: at
128 heads and k = 2048, 1 MiB of fp32 a query token for each).

How the k selected rows reach VMEM (`gather`), the choice of this module:

  "xla"  XLA gathers each query's rows into [t, k, e] in HBM (a row gather), and Pallas' pipeline streams them in
         blocks of `block` slots (double-buffered). Robust (plain BlockSpecs), but the gathered rows go to HBM and
         back: per query token k*e*2 bytes read + written + read again (3 x 2.36 MB at bf16), and XLA's row gather
         costs ~8-10 ns a row on a v5e (docs/kernels.md, the decode step): ~20 us for 2048 rows.
  "dma"  The kernel DMAs each selected row from the kv array in HBM into a VMEM buffer (two slots: block j+1's rows
         started before block j is computed, one byte-counting semaphore wait a block), FlashMLA's gather into
         shared memory: k*e*4 bytes read once (4.7 MB: 5.8 us at 819 GB/s), no HBM round trip, but k DMAs a query
         token (2048 descriptors of 2304 bytes; ~20-26 VLIW bundles to issue each, measured for the decode kernel's
         32-bit pools: ~13 ns a row, so ~28 us a token unless the issue hides under the matmuls). The rows are
         32-bit: Mosaic (libtpu 0.0.42.1, compiled for a v5e) refuses a one-row DMA into a bf16 VMEM buffer at a row
         that is not a whole (16, 128) tile's, so a bf16 kv is widened to f32 by XLA once a call (s*e*6 bytes: 0.14
         ms at 32K keys, ~5% of a 256-token block's MXU bound) and each block narrowed back in VMEM (exact).

Per query token at the official shapes (h 128, e 576, c 512, k 2048), the MXU work is 2*h*k*(e+c) = 0.57 GFLOP
forward (2.9 us at the v5e's 197 TFLOP/s) and 2*h*k*(3e+2c) = 1.44 GFLOP backward (7.3 us): both gathers are
bounded by their per-row cost, not by bytes or FLOPs. Rejected: loading the key range in blocks and selecting in
VMEM (a one-hot [k, block] x [block, e] matmul costs 2*k*s*e FLOP a token, 309 GFLOP at 128K keys; masked dense
compute over the touched blocks is dense attention once 2048 keys spread over 1024 blocks). Which gather wins is
for the chip to say: both are backend.py ways (gather_attention "pallas" = "xla" rows, "pallas_dma"), neither in
the tpu row until timed (benchmarks/long_context.py --force gather_attention=...).

Blocks: `block` slots a grid step (BLOCK_SLOTS; backend.mosaic_block makes it 128 lanes or the whole k), the
slots padded to whole blocks (invalid). Grid (b*t query tokens, slot blocks), the second axis sequential.
`interpret=None` runs Pallas' interpreter off a TPU (tests/unit/test_sparse_mla_kernel.py holds every output and
gradient to the XLA path on the CPU, and exports the Mosaic lowering at the official shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from MaxText.kernels.backend import dot_precision, mosaic_block, pallas_interpret
from MaxText.kernels.topk_indices import gather_rows

BLOCK_SLOTS = 512  # selected slots a grid step: [h, 512] fp32 logits (256 KiB at h 128); not yet timed on a chip
GATHERS = ("xla", "dma")  # how the selected rows reach VMEM (module doc)
GATHER_OF_WAY = {"pallas": "xla", "pallas_dma": "dma"}  # backend.py's gather_attention ways -> `gather`
_NT = (((1,), (1,)), ((), ()))  # dot_general: [m,k] x [n,k] -> [m,n]
_NN = (((1,), (0,)), ((), ()))  # [m,k] x [k,n] -> [m,n]
_TN = (((0,), (0,)), ((), ()))  # [k,m] x [k,n] -> [m,n]


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """An MXU dot with fp32 accumulation; fp32 operands at full precision (bf16 ones are exact in one pass)."""
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=dot_precision(a.dtype))


def _logits(q: jax.Array, kv: jax.Array, ok_ref, scale: float) -> jax.Array:
  """q [h,e], kv [block,e] (the selected rows), ok_ref [1,1,block] int32 -> logits [h,block] fp32, -inf where
  the slot is not valid (so exp gives exactly 0 there, whatever row the slot read)."""
  logits = _dot(q, kv, _NT) * scale  # [h,block]
  return jnp.where(ok_ref[0] > 0, logits, -jnp.inf)  # ok [1,block] broadcast over heads


# ---- the selected rows of a grid step: Pallas' pipeline over XLA-gathered rows, or DMAs from HBM


def _start_rows(kv_hbm, buf, sems, ids_ref, slot, n: int) -> None:
  """Start the n DMAs of one block: row ids_ref[0,0,i] of kv_hbm [N,e] into buf[slot, i], on semaphore slot."""
  @pl.loop(0, n)
  def _(i):
    pltpu.make_async_copy(kv_hbm.at[pl.ds(ids_ref[0, 0, i], 1)], buf.at[slot, pl.ds(i, 1)], sems.at[slot]).start()


def _dma_rows(kv_hbm, buf, sems, ids_now, ids_next, n: int) -> jax.Array:
  """Block j's rows [n,e] (slot j % 2 of buf [2,n,e]), block j+1's DMAs started first (block 0's at j == 0).
  One wait a block, described as a copy of the whole slot (a DMA semaphore counts bytes: paged_decode's rule)."""
  j, last = pl.program_id(1), pl.num_programs(1) - 1
  slot = j % 2

  @pl.when(j == 0)
  def _():
    _start_rows(kv_hbm, buf, sems, ids_now, 0, n)

  @pl.when(j < last)
  def _():
    _start_rows(kv_hbm, buf, sems, ids_next, 1 - slot, n)

  pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[slot]).wait()
  return buf[slot]


def _kernel(*refs, body, n_in: int, n_out: int, gather: str, block: int, dtype):
  """Splits a pallas_call's refs (ins, the rows' refs, outs, scratch) and hands `body` this step's rows [block,e]
  in `dtype` (q's): body(kv, *ins, *outs, *scratch)."""
  ins, rest = refs[:n_in], refs[n_in:]
  if gather == "dma":
    (ids_now, ids_next, kv_hbm), rest = rest[:3], rest[3:]
    outs, (buf, sems, *scratch) = rest[:n_out], rest[n_out:]
    kv = _dma_rows(kv_hbm, buf, sems, ids_now, ids_next, block).astype(dtype)  # 32-bit rows back to q's dtype
  else:
    (kv_ref,), rest = rest[:1], rest[1:]
    outs, scratch = rest[:n_out], rest[n_out:]
    kv = kv_ref[0]  # [block,e]
  body(kv, *ins, *outs, *scratch)


class _Layout:
  """One call's flattened operands: R = b*t query tokens, k slots padded to n_blocks blocks of `block`."""

  def __init__(self, q: jax.Array, kv: jax.Array, idx: jax.Array, ok: jax.Array, gather: str, block: int):
    if gather not in GATHERS:
      raise ValueError(f"sparse_mla_kernel: gather={gather!r}; expected one of {GATHERS}")
    b, t, h, e = q.shape  # q [b,t,h,e], kv [b,s,e], idx/ok [b,t,k]
    s, k = kv.shape[1], idx.shape[-1]
    self.block, kp = mosaic_block(k, block)  # 128 lanes (ok's block) or the whole k
    self.n_blocks, self.k, self.gather = kp // self.block, k, gather
    self.shape = (b, t, h, e)
    pad = ((0, 0), (0, 0), (0, kp - k))
    idx = jnp.pad(jnp.clip(idx, 0, s - 1).astype(jnp.int32), pad)  # [b,t,k']: -1 / invalid slots read row 0
    self.ok = jnp.pad(ok, pad).astype(jnp.int32).reshape(b * t, 1, kp)  # [R,1,k']: padding slots invalid
    self.flat_ids = (idx + (jnp.arange(b, dtype=jnp.int32) * s)[:, None, None]).reshape(b * t, kp)  # [R,k'] in [b*s]
    self.kv_flat = kv.reshape(b * s, e)  # [b*s,e]
    self.dtype = q.dtype
    self.q = q.reshape(b * t, h, e)  # [R,h,e]
    self._idx = idx

  def rows(self):
    """(operands, specs, scratch) of the selected rows: [R,k',e] gathered by XLA, or the ids and kv for DMAs."""
    blk, nb, e = self.block, self.n_blocks, self.shape[-1]
    if self.gather == "xla":
      b, t = self.shape[:2]
      g = gather_rows(self.kv_flat.reshape(b, -1, e), self._idx).reshape(b * t, -1, e)  # [R,k',e]
      return [g], [pl.BlockSpec((1, blk, e), lambda r, j: (r, j, 0))], []
    ids = self.flat_ids.reshape(-1, 1, blk)  # [R*nb,1,blk]: a block's ids a whole SMEM array row
    specs = [pl.BlockSpec((1, 1, blk), lambda r, j: (r * nb + j, 0, 0), memory_space=pltpu.SMEM),
             pl.BlockSpec((1, 1, blk), lambda r, j: (r * nb + jnp.minimum(j + 1, nb - 1), 0, 0),
                          memory_space=pltpu.SMEM),
             pl.BlockSpec(memory_space=pl.ANY)]
    # 32-bit rows: Mosaic slices a VMEM buffer of 16-bit rows only at whole (16, 128) tiles ("offsets along tiled
    # dimensions must be aligned"), so a bf16 kv is widened (exactly) once a call, s*e*6 bytes of XLA traffic
    kv32 = self.kv_flat.astype(jnp.float32) if self.kv_flat.dtype.itemsize < 4 else self.kv_flat
    return [ids, ids, kv32], specs, [pltpu.VMEM((2, blk, e), kv32.dtype), pltpu.SemaphoreType.DMA((2,))]

  def call(self, body, ins, in_specs, out_shape, out_specs, scratch, interpret):
    """pallas_call over grid (R, n_blocks): ins (with their specs) then the rows, out_shape/out_specs, scratch."""
    rows, row_specs, row_scratch = self.rows()
    kernel = functools.partial(_kernel, body=body, n_in=len(ins), n_out=len(out_shape), gather=self.gather,
                               block=self.block, dtype=self.dtype)
    return pl.pallas_call(
        kernel, grid=(self.q.shape[0], self.n_blocks), in_specs=[*in_specs, *row_specs], out_specs=out_specs,
        out_shape=out_shape, scratch_shapes=[*row_scratch, *scratch],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pallas_interpret(interpret))(*ins, *rows)

  def ok_spec(self):
    return pl.BlockSpec((1, 1, self.block), lambda r, j: (r, 0, j))  # [R,1,k'] -> [1,1,block]

  def per_row(self, width: int):
    return pl.BlockSpec((1, self.shape[2], width), lambda r, j: (r, 0, 0))  # [R,h,width] resident over j


# ---- the three kernels' bodies (one grid step: query token r, slot block j)


def _fwd_body(kv, ok_ref, q_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale: float, c: int):
  j, last = pl.program_id(1), pl.num_programs(1) - 1

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, jnp.finfo(jnp.float32).min, jnp.float32)  # finite: exp(-inf - m) = 0
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  logits = _logits(q_ref[0], kv, ok_ref, scale)  # [h,block]
  m_old = m_ref[...]  # [h,1]
  m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))  # [h,1]
  p = jnp.exp(logits - m_new)  # [h,block]
  alpha = jnp.exp(m_old - m_new)  # [h,1]
  l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
  acc_ref[...] = acc_ref[...] * alpha + _dot(p.astype(kv.dtype), kv[:, :c], _NN)  # [h,c]
  m_ref[...] = m_new

  @pl.when(j == last)
  def _():
    l = l_ref[...]  # [h,1]; 0 where no slot is valid: o 0, lse 0 (any finite: every p is masked to 0)
    o_ref[0] = (acc_ref[...] / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)).astype(o_ref.dtype)
    lse_ref[0] = jnp.where(l > 0, m_ref[...] + jnp.log(jnp.maximum(l, jnp.finfo(jnp.float32).tiny)), 0.0)


def _bwd_body(kv, ok_ref, q_ref, do_ref, lse_ref, d_ref, dq_ref, dkv_ref, dq_acc, *, scale: float, c: int):
  j, last = pl.program_id(1), pl.num_programs(1) - 1

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  q, dt = q_ref[0], kv.dtype  # [h,e]
  p = jnp.exp(_logits(q, kv, ok_ref, scale) - lse_ref[0])  # [h,block]; 0 at invalid slots
  do = do_ref[0].astype(dt)  # [h,c]
  dp = _dot(do, kv[:, :c], _NT)  # [h,block]
  ds = p * (dp - d_ref[0]) * scale  # [h,block]: d(logits before the scale)
  dq_acc[...] += _dot(ds.astype(dt), kv, _NN)  # [h,e]
  dkv_ref[0] = _dot(ds.astype(dt), q.astype(dt), _TN)  # [block,e]
  dkv_ref[0, :, :c] += _dot(p.astype(dt), do, _TN)  # [block,c]: the values' part

  @pl.when(j == last)
  def _():
    dq_ref[0] = dq_acc[...]


def _probs_body(kv, ok_ref, q_ref, lse_ref, ph_ref, *, scale: float):
  p = jnp.exp(_logits(q_ref[0], kv, ok_ref, scale) - lse_ref[0])  # [h,block]
  ph_ref[0] = jnp.sum(p, axis=0, keepdims=True)  # [1,block]: a sublane reduction, lane-dense out


# ---- the calls, and the custom VJP


def _forward(lay: _Layout, scale: float, c: int, interpret) -> tuple[jax.Array, jax.Array]:
  """-> o [R,h,c] in q's dtype, lse [R,h,1] fp32."""
  r, h, e = lay.q.shape
  f32 = jnp.float32
  return lay.call(functools.partial(_fwd_body, scale=scale, c=c), [lay.ok, lay.q], [lay.ok_spec(), lay.per_row(e)],
                  [jax.ShapeDtypeStruct((r, h, c), lay.q.dtype), jax.ShapeDtypeStruct((r, h, 1), f32)],
                  [lay.per_row(c), lay.per_row(1)],
                  [pltpu.VMEM((h, 1), f32), pltpu.VMEM((h, 1), f32), pltpu.VMEM((h, c), f32)], interpret)


def _head_probs(lay: _Layout, lse: jax.Array, scale: float, interpret) -> jax.Array:
  """-> p_heads [R,k'] fp32: each slot's probability summed over the heads."""
  r, h, e = lay.q.shape
  (ph,) = lay.call(functools.partial(_probs_body, scale=scale), [lay.ok, lay.q, lse],
                   [lay.ok_spec(), lay.per_row(e), lay.per_row(1)],
                   [jax.ShapeDtypeStruct((r, 1, lay.n_blocks * lay.block), jnp.float32)], [lay.ok_spec()], [], interpret)
  return ph[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attend(q, kv, idx, ok, scale, c, gather, block, interpret):
  return _attend_fwd(q, kv, idx, ok, scale, c, gather, block, interpret)[0]


def _attend_fwd(q, kv, idx, ok, scale, c, gather, block, interpret):
  lay = _Layout(q, kv, idx, ok, gather, block)
  b, t, h, _ = lay.shape
  o, lse = _forward(lay, scale, c, interpret)  # [R,h,c], [R,h,1]
  p_heads = _head_probs(lay, lse, scale, interpret)[:, :lay.k]  # [R,k]
  return (o.reshape(b, t, h, c), p_heads.reshape(b, t, lay.k)), (q, kv, idx, ok, o, lse)


def _attend_bwd(scale, c, gather, block, interpret, res, cts):
  """dq from the kernel; d kv the per-selection dkv_g scatter-added by XLA (p_heads carries no gradient)."""
  q, kv, idx, ok, o, lse = res
  lay = _Layout(q, kv, idx, ok, gather, block)
  r, h, e = lay.q.shape
  do = cts[0].astype(jnp.float32).reshape(r, h, c)  # [R,h,c]
  d = jnp.sum(do * o.astype(jnp.float32), axis=-1, keepdims=True)  # [R,h,1] = sum_k p dp
  f32 = jnp.float32
  dq, dkv_g = lay.call(functools.partial(_bwd_body, scale=scale, c=c), [lay.ok, lay.q, do, lse, d],
                       [lay.ok_spec(), lay.per_row(e), lay.per_row(c), lay.per_row(1), lay.per_row(1)],
                       [jax.ShapeDtypeStruct((r, h, e), f32), jax.ShapeDtypeStruct((r, lay.n_blocks * lay.block, e), f32)],
                       [lay.per_row(e), pl.BlockSpec((1, lay.block, e), lambda i, j: (i, j, 0))],
                       [pltpu.VMEM((h, e), f32)], interpret)  # [R,h,e], [R,k',e]
  ids = lay.flat_ids[:, :lay.k].reshape(-1)  # [R*k]
  dkv = jnp.zeros(lay.kv_flat.shape, f32).at[ids].add(dkv_g[:, :lay.k].reshape(-1, e))  # [b*s,e]
  return dq.reshape(q.shape).astype(q.dtype), dkv.reshape(kv.shape).astype(kv.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def sparse_mla_attend(q: jax.Array, kv: jax.Array, idx: jax.Array, ok: jax.Array, scale: float, c: int, *,
                      gather: str = "xla", block: int | None = None, interpret: bool | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """sparse_attention._attend_block's function by the kernels (module doc), differentiable in q and kv.

  q [b,t,h,e] = [q_lat | q_pe], kv [b,s,e] = [c_kv | k_pe] (fp32 or bf16, one dtype), idx [b,t,k] int32 key
  positions (an invalid slot may hold anything, -1 included), ok [b,t,k] bool, scale the softmax scale, c the
  latent width -> o_lat [b,t,h,c] in q's dtype and p_heads [b,t,k] fp32 (probabilities summed over heads; no
  gradient flows back through it). A query with no valid slot gets o_lat 0, p_heads 0 and no gradient. block:
  slots a grid step (None: BLOCK_SLOTS)."""
  return _attend(q, kv, idx, ok, scale, c, gather, BLOCK_SLOTS if block is None else block, interpret)


__all__ = ["BLOCK_SLOTS", "GATHERS", "GATHER_OF_WAY", "sparse_mla_attend"]
