"""Pallas (Triton, GPU) kernels of the paged decode step: paged_decode.py's two functions for a GPU.

The same two functions as the Mosaic kernels of paged_decode.py, and held to the same XLA references
(`paged_decode.paged_index_scores_xla`, `paged_decode.sparse_mla_decode_xla`), written for Triton's
model: no DMAs or VMEM buffers, each program reads the pool rows it needs by a gathered load (a row
id a key or slot, as FlashMLA's sparse decode and DeepGEMM's paged MQA logits read their caches), so
nothing is gathered to HBM first.

  paged_index_scores   grid (rows, blocks of pages): a program reads its block's page ids from the
                       table, its `width` keys [width, d] from the pool where the pages lie, and
                       writes the block's scores sum_h w[h] relu(q[h] . k) [width] (the fp8 keys'
                       scales applied in the kernel, -inf past the row's position). A block past the
                       row's position reads nothing. fp8 keys are decoded to bf16 (exact: e4m3 is a
                       subset of bf16) for the tensor cores with fp32 accumulation; the queries come
                       as bf16 parts (one for fp8_scored_queries' e4m3 values, three for fp32
                       queries: paged_decode._split_bf16, fp32-accurate), their dots summed.
  sparse_mla_decode    grid (rows, blocks of heads): a program loops over the row's k selected slots a
                       block at a time, reads each block's latents [blk, c] a 128-block at a time
                       (c_kv's codes, its scales, k_pe) straight from the pools, and runs the online
                       softmax in fp32. fp8 latents stay codes (bf16, exact) in both dots; each
                       128-block's scale multiplies that block's logits and, for the PV product, the
                       probabilities: logits = sum_g s_g (q_g . codes_g), o_g = (p s_g) . codes_g.
                       The query (and the scaled probabilities) as `parts` bf16 parts: 3 (default)
                       for fp32 accuracy, 1 for FlashMLA's bf16 arithmetic (a third of the dots).

Triton's constraints (checked when a GPU compiles the kernel, not by the lowering): every block a
power of 2, each dot's dimensions >= 16. The wrappers raise one clear line where a shape breaks them.
`interpret=True` (the default off a GPU: backend.pallas_interpret) runs the kernels with Pallas'
interpreter on any backend; tests/unit/test_paged_decode_gpu.py holds them to the XLA references
on the CPU and lowers them for CUDA (Triton IR) on every commit. Design notes: docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.backend import pallas_interpret
from MaxText.kernels.cached_attention import merge_attention
from MaxText.kernels.fp8_blocks import is_paired
from MaxText.kernels.paged_decode import (
  FP8_BLOCK,
  NEG_INF,
  _bf16_bits_to_f32,
  _bytes,
  _split_bf16,
  as_values,
  e4m3_to_f32,
)

_NT = (((1,), (1,)), ((), ()))  # dot_general: [m,k] x [n,k] -> [m,n]
_NN = (((1,), (0,)), ((), ()))  # [m,k] x [k,n] -> [m,n]
_HI = jax.lax.Precision.HIGHEST  # an fp32 dot in Triton: IEEE (no TF32), the fp32 pools' path


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _check_block(name: str, **dims: int) -> None:
  """Triton's block rules: every named dim a power of 2 and >= 16 (a dot's minimum)."""
  bad = {k: v for k, v in dims.items() if not (_pow2(v) and v >= 16)}
  if bad:
    raise ValueError(f"{name}: Triton blocks are powers of 2 of at least 16, got "
                     + ", ".join(f"{k}={v}" for k, v in bad.items()))


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """fp32 accumulate; fp32 operands at IEEE precision, bf16 ones on the tensor cores."""
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                             precision=_HI if a.dtype == jnp.float32 else None)


def _parts_dot(parts: list[jax.Array], b: jax.Array, dims) -> jax.Array:
  """sum_i parts[i] . b: a bf16 split of an fp32 operand against a bf16-exact b (fp32-accurate for 3 parts)."""
  out = _dot(parts[0], b, dims)
  for x in parts[1:]:
    out = out + _dot(x, b, dims)
  return out


def _as_parts(x: jax.Array, parts: int) -> list[jax.Array]:
  """f32 x -> `parts` bf16 parts (paged_decode._split_bf16); bf16 x as it is."""
  return [x] if x.dtype == jnp.bfloat16 else _split_bf16(x.astype(jnp.float32), parts)


def _fp8_bf16(bits: jax.Array, native: bool) -> jax.Array:
  """e4m3 bits (uint8) -> their values as bf16, exactly: by the hardware's conversion (native: sm89 and later,
  Triton's fp8 cast; a cvt instruction two codes at a time) or by integer ops (e4m3_to_f32: ~13 an element,
  any GPU)."""
  if native:
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.bfloat16)
  return e4m3_to_f32(bits).astype(jnp.bfloat16)


def _params(num_warps: int, num_stages: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---- (a) paged indexer scoring

def _score_kernel(pos_ref, tab_ref, q_ref, w_ref, k_ref, *rest, page: int, pages: int, fp8: bool, native: bool):
  ks_ref, out_ref = rest if fp8 else (None, rest[0])
  b, j = pl.program_id(0), pl.program_id(1)
  width = pages * page
  pos = pos_ref[b]
  t = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)  # [width] a key's place in the block

  @pl.when(j * width > pos)  # past the row's position: nothing read
  def _():
    out_ref[0, :] = jnp.full((width,), NEG_INF, jnp.float32)

  @pl.when(j * width <= pos)
  def _():
    ids = tab_ref[b, j * pages + t // page]  # [width] page ids (>= 0), one a key
    slots = ids * page + t % page  # [width]
    keys = k_ref[slots, :]  # [width, d] as stored: a gathered load from the pool
    w = w_ref[0, :]  # [H]
    if fp8:
      q = [q_ref[0, i] for i in range(q_ref.shape[1])]  # bf16 parts [H, d]
      if native and len(q) == 1:  # e4m3 values both: fp8 x fp8 on the tensor cores (DeepGEMM's MQA logits)
        f8 = jnp.float8_e4m3fn
        logits = _dot(q[0].astype(f8), jax.lax.bitcast_convert_type(keys, f8), _NT)  # [H, width], exact products
      else:
        logits = _parts_dot(q, _fp8_bf16(keys, native), _NT)  # [H, width]
    else:
      logits = _dot(q_ref[0, 0], keys.astype(jnp.float32), _NT)  # [H, width] fp32
    scores = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0)  # [width]
    if fp8:
      scores = scores * ks_ref[slots]  # each key's scale (> 0 where written: commutes with relu and the sum)
    out_ref[0, :] = jnp.where(j * width + t <= pos, scores, NEG_INF)


def paged_index_scores(q: jax.Array, q_scale: jax.Array | None, w: jax.Array, idx_k: jax.Array,
                       idx_k_scale: jax.Array | None, table: jax.Array, pos: jax.Array, page: int, *,
                       pages_per_block: int = 2, num_warps: int = 4, num_stages: int = 2, native_fp8: bool = False,
                       interpret: bool | None = None) -> jax.Array:
  """paged_decode.paged_index_scores' function (the same arguments and result) by a Triton kernel:
  scores [B, P*page] fp32 = sum_h w[h] relu(q[h] . k[s]), -inf past pos[b]. idx_k [N,d] in slot
  order (uint8 fp8 bits with idx_k_scale [N,1], or f32; not the tpu row's paired order); P a multiple
  of pages_per_block (pad the table with -1); pages_per_block * page and H powers of 2 >= 16. native_fp8: the
  keys converted by the hardware (sm89+), and with e4m3 queries (bf16 values or fp8 bits) an fp8 x fp8 dot."""
  fp8 = idx_k_scale is not None
  b, h, d = q.shape
  p = table.shape[1]
  if is_paired(idx_k):
    raise ValueError("paged_decode_gpu.paged_index_scores: a paired idx_k pool is the tpu row's (key_order); "
                     "a GPU's pool holds its keys in slot order")
  if p % pages_per_block:
    raise ValueError(f"paged_decode_gpu.paged_index_scores: {p} pages is not a multiple of "
                     f"pages_per_block={pages_per_block}")
  if fp8 and idx_k_scale.shape[-1] != 1:
    raise ValueError(f"paged_decode_gpu.paged_index_scores: fp8 keys need one scale per key (d = 128), "
                     f"got {idx_k_scale.shape}")
  if (q.dtype == jnp.uint8) != (q_scale is not None) or (q_scale is not None and not fp8):
    raise ValueError("paged_decode_gpu.paged_index_scores: fp8 queries (uint8 bits) come with q_scale, "
                     "and with fp8 keys")
  width = pages_per_block * page
  _check_block("paged_decode_gpu.paged_index_scores", keys_a_block=width, heads=h, head_dim=d)
  w = w.astype(jnp.float32) * (1.0 if q_scale is None else q_scale)  # relu(s x) = s relu(x): q's scale joins w
  if fp8:  # the queries as bf16 parts [B, parts, H, d]: e4m3 values (one, exact), bf16 (one), f32 (three)
    qin = jnp.stack(_as_parts(as_values(q).astype(jnp.bfloat16) if q.dtype == jnp.uint8 else q, 3), axis=1)
  else:
    qin = q.astype(jnp.float32)[:, None]  # [B, 1, H, d]
  ins = [jnp.maximum(pos, -1).astype(jnp.int32), jnp.maximum(table, 0).astype(jnp.int32), qin, w, idx_k]
  specs = [None, None, pl.BlockSpec((1, qin.shape[1], h, d), lambda i, j: (i, 0, 0, 0)),
           pl.BlockSpec((1, h), lambda i, j: (i, 0)), None]
  if fp8:
    ins.append(idx_k_scale.astype(jnp.float32).reshape(-1))  # [N]
    specs.append(None)
  kernel = functools.partial(_score_kernel, page=page, pages=pages_per_block, fp8=fp8, native=native_fp8)
  return pl.pallas_call(
      kernel, grid=(b, p // pages_per_block),
      in_specs=[s if s is not None else pl.BlockSpec(memory_space=pl.ANY) for s in specs],
      out_specs=pl.BlockSpec((1, width), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((b, p * page), jnp.float32),
      compiler_params=_params(num_warps, num_stages), interpret=pallas_interpret(interpret, "gpu"),
      name="paged_index_scores_gpu")(*ins)


# ---- (b) sparse MLA decode

def _mla_kernel(ids_ref, valid_ref, q_ref, qpe_ref, c_ref, pe_ref, *rest, blk: int, groups: int, gw: int,
                scale: float, fp8: bool, parts: int, native: bool):
  cs_ref, out_ref, lse_ref = rest if fp8 else (None, *rest)  # out [1,1,hb,c], lse [1,1,hb]: this split's
  hb, k = q_ref.shape[2], ids_ref.shape[1]
  lane = jax.lax.broadcasted_iota(jnp.int32, (gw,), 0)  # [gw]

  def step(i, carry):  # the query read in the loop (cached), not held: groups x parts x [hb, gw] would spill
    m_old, l_old, acc = carry  # [hb], [hb], groups x [hb, gw]
    qg = [[q_ref[0, p, :, pl.ds(g * gw, gw)] for p in range(q_ref.shape[1])] for g in range(groups)]  # [hb, gw]
    qr = [qpe_ref[0, p] for p in range(qpe_ref.shape[1])]  # [hb, r] each
    ids = ids_ref[0, pl.ds(i * blk, blk)]  # [blk] slot ids (clipped)
    ok = valid_ref[0, pl.ds(i * blk, blk)] > 0  # [blk]
    pe = pe_ref[ids, :]  # [blk, r] as stored
    pe = _bf16_bits_to_f32(pe).astype(jnp.bfloat16) if pe.dtype == jnp.uint16 else pe.astype(jnp.float32)
    logits = _parts_dot(qr, pe, _NT)  # [hb, blk]
    codes, scales = [], []
    for g in range(groups):
      cg = c_ref[ids[:, None], g * gw + lane[None, :]]  # [blk, gw] a 128-block of the latents, as stored
      if fp8:
        cg = _fp8_bf16(cg, native)  # the codes' values (exact)
        sg = cs_ref[ids, g]  # [blk] the block's scale a slot
        logits = logits + _parts_dot(qg[g], cg, _NT) * sg[None, :]
        scales.append(sg)
      else:
        cg = cg.astype(jnp.float32)
        logits = logits + _dot(qg[g][0], cg, _NT)
      codes.append(cg)
    logits = jnp.where(ok[None, :], logits * scale, NEG_INF)  # [hb, blk]
    m_new = jnp.maximum(m_old, jnp.max(logits, axis=1))  # finite: m starts at a finite floor
    p = jnp.exp(logits - m_new[:, None])  # [hb, blk]; an invalid slot 0
    alpha = jnp.exp(m_old - m_new)  # [hb]
    l_new = l_old * alpha + jnp.sum(p, axis=1)
    new_acc = []
    for g in range(groups):
      if fp8:  # o_g += (p s_g) . codes_g: the probabilities times the block's scale, in bf16 parts
        pv = _parts_dot(_as_parts(p * scales[g][None, :], parts), codes[g], _NN)  # [hb, gw]
      else:
        pv = _dot(p, codes[g], _NN)
      new_acc.append(acc[g] * alpha[:, None] + pv)
    return m_new, l_new, tuple(new_acc)

  init = (jnp.full((hb,), jnp.finfo(jnp.float32).min, jnp.float32), jnp.zeros((hb,), jnp.float32),
          tuple(jnp.zeros((hb, gw), jnp.float32) for _ in range(groups)))
  m, l, acc = jax.lax.fori_loop(0, k // blk, step, init)
  inv = 1.0 / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)  # [hb]; no valid slot: acc 0, so 0
  for g in range(groups):
    out_ref[0, 0, :, pl.ds(g * gw, gw)] = acc[g] * inv[:, None]
  # log sum_k exp(logit_k): -inf with no valid slot (l = 0)
  lse_ref[0, 0, :] = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, jnp.finfo(jnp.float32).tiny)), NEG_INF)


def sparse_mla_decode(q_abs: jax.Array, q_pe: jax.Array, ids: jax.Array, valid: jax.Array, c_kv: jax.Array,
                      k_pe: jax.Array, c_kv_scale: jax.Array | None, scale: float, *, block: int = 32,
                      heads_per_program: int = 32, parts: int = 3, num_warps: int = 8, num_stages: int = 2,
                      splits: int = 1, return_lse: bool = False, native_fp8: bool = False,
                      interpret: bool | None = None):
  """paged_decode.sparse_mla_decode's function (the same arguments and result) by a Triton kernel:
  o_lat [B,H,c] fp32, softmax over each row's valid selected slots of (q_abs.c + q_pe.pe) * scale, times
  c; a row with no valid slot gets 0. The pools as a GPU's row holds them: c_kv uint8 fp8 bits [N,c] or
  uint32 words [N,c/4] with c_kv_scale [N,c/128], or f32 [N,c]; k_pe [N,r] uint16 bf16 bits or f32.
  parts: the bf16 parts of the fp32 query and scaled probabilities against the fp8 codes (3: fp32-
  accurate; 1: bf16, FlashMLA's arithmetic). K a multiple of block; block, heads_per_program, c/128
  (fp8) or c, and r powers of 2 >= 16. return_lse: (o_lat, lse [B,H] fp32), lse the log of the softmax's
  denominator (-inf for a row with no valid slot), to merge other keys in afterwards (cached_attention.merge_row).
  native_fp8: the codes converted to bf16 by the hardware (sm89+), not by integer ops. splits: the K slots in
  that many programs (a grid axis; split-KV, as FlashMLA's num_splits: B * H / heads_per_program programs alone
  leave most of a GPU's SMs idle at few rows), their outputs merged by their lse (cached_attention.merge_attention);
  K a multiple of splits * block."""
  fp8 = c_kv_scale is not None
  b, h, _ = q_abs.shape
  r, k = q_pe.shape[-1], ids.shape[1]
  codes = _bytes(c_kv) if c_kv.dtype == jnp.uint32 else c_kv  # [N, c] (fp8 words viewed as codes: free)
  n, c = codes.shape
  hb = min(heads_per_program, h)
  if k % (block * splits) or h % hb:
    raise ValueError(f"paged_decode_gpu.sparse_mla_decode: {k} slots a row must be a multiple of block={block} "
                     f"x splits={splits}, and {h} heads of heads_per_program={hb}")
  if k_pe.shape[0] != n or k_pe.dtype not in (jnp.uint16, jnp.float32) or (
      fp8 and c_kv_scale.shape != (n, c // FP8_BLOCK)):
    raise ValueError("paged_decode_gpu.sparse_mla_decode: a GPU's pools hold one slot a row (k_pe [N,r] uint16 "
                     f"or f32, c_kv_scale [N,c/128]), got k_pe {k_pe.shape} {k_pe.dtype}, c_kv {codes.shape}, "
                     f"c_kv_scale {None if c_kv_scale is None else c_kv_scale.shape}")
  gw = FP8_BLOCK if fp8 else c
  _check_block("paged_decode_gpu.sparse_mla_decode", block=block, heads_per_program=hb, group=gw, rope=r)
  ids = jnp.clip(ids, 0, n - 1).astype(jnp.int32)
  split = lambda x: jnp.stack(_as_parts(x, parts), axis=1)  # [B, parts, ...] bf16
  qin = split(q_abs) if fp8 else q_abs.astype(jnp.float32)[:, None]  # [B, parts, H, c] bf16 (one: a bf16 query)
  qpe = split(q_pe) if k_pe.dtype == jnp.uint16 else q_pe.astype(jnp.float32)[:, None]  # [B, parts', H, r]
  ins = [ids, valid.astype(jnp.int32), qin, qpe, codes, k_pe]
  any_ = pl.BlockSpec(memory_space=pl.ANY)
  ks = k // splits  # slots a program: grid (rows, head blocks, splits)
  specs = [pl.BlockSpec((1, ks), lambda i, j, s: (i, s)), pl.BlockSpec((1, ks), lambda i, j, s: (i, s)),
           pl.BlockSpec((1, qin.shape[1], hb, c), lambda i, j, s: (i, 0, j, 0)),
           pl.BlockSpec((1, qpe.shape[1], hb, r), lambda i, j, s: (i, 0, j, 0)), any_, any_]
  if fp8:
    ins.append(c_kv_scale.astype(jnp.float32))
    specs.append(any_)
  kernel = functools.partial(_mla_kernel, blk=block, groups=c // gw, gw=gw, scale=scale, fp8=fp8, parts=parts,
                             native=native_fp8)
  o, lse = pl.pallas_call(
      kernel, grid=(b, h // hb, splits), in_specs=specs,
      out_specs=[pl.BlockSpec((1, 1, hb, c), lambda i, j, s: (i, s, j, 0)),
                 pl.BlockSpec((1, 1, hb), lambda i, j, s: (i, s, j))],
      out_shape=[jax.ShapeDtypeStruct((b, splits, h, c), jnp.float32), jax.ShapeDtypeStruct((b, splits, h), jnp.float32)],
      compiler_params=_params(num_warps, num_stages), interpret=pallas_interpret(interpret, "gpu"),
      name="sparse_mla_decode_gpu")(*ins)  # [B,S,H,c], [B,S,H]
  o, lse = merge_attention(o, lse) if splits > 1 else (o[:, 0], lse[:, 0])  # [B,H,c], [B,H]
  return (o, lse) if return_lse else o


__all__ = ["paged_index_scores", "sparse_mla_decode"]
