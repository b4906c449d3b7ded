"""Pallas (Mosaic TPU) kernels of the paged decode step, and their XLA references.

Two kernels over the paged pools (inference/paged_cache.py), one row (sequence) per grid step of
the first axis, a block of pages or slots per step of the second:

  paged_index_scores   the indexer's scores of one decode query per row over every cached key:
                       q [B,H,d], w [B,H] (times H**-0.5 d**-0.5 folded in by the caller: see
                       `index_weights`), the key pool idx_k [N,d] (fp32, or fp8 bits uint8 with a
                       scale [N,1]) through the page table [B,P] -> scores [B, P*page] fp32 (-inf past
                       each row's position). Keys are DMA'd from the pool a page at a time ([page,
                       d], 8 KiB in fp8), the next block's pages started before this block is
                       scored (two VMEM buffers); the fp8 keys' scales multiply the kernel's scores
                       afterwards (XLA; they are > 0, so they commute with relu and the head sum);
                       fp8 keys and queries decoded to bf16 (exact: e4m3 is a subset of bf16) and
                       multiplied on the MXU with fp32 accumulation, so fp8 x fp8 products are exact
                       and the scales apply after the dot (as DeepGEMM's fp8 MQA logits); fp32
                       queries (the engine's) split into 3 bf16 parts, each one MXU pass against the
                       bf16-exact keys (fp32-accurate: half of HIGHEST's 6 passes). logits [H, width],
                       the head sum a sublane reduction on the VPU (no second matmul). The
                       [B, S] scores go to HBM (4 bytes a key against the 128 + 4 the key costs to
                       read in fp8: 3%) and the selection (selection.py, binned) runs on them.
  sparse_mla_decode    absorbed MLA of one decode query per row over its k selected slots: q_abs
                       [B,H,c], q_pe [B,H,r], slot ids [B,K] (already through the page table) with a
                       validity mask, the latent pool c_kv [N,c] (fp32, or fp8 bits with scales
                       [N, c/128]) and k_pe [N,r] (fp32, or bf16 bits uint16) -> o_lat [B,H,c] fp32.
                       The selected rows are gathered as stored by XLA (a per-slot DMA does not
                       lower: docs/kernels.md), streamed in blocks of slots by Pallas' pipeline,
                       fp8 dequantized in VMEM; online softmax in fp32 over the blocks.

fp8 and bf16 fields arrive as the pools hold them (their bits, kv_cache.storage_dtype) and are
decoded with integer ops (`e4m3_to_f32`, `_bf16_bits_to_f32`): the v5e has no fp8 unit, and bit
arithmetic lowers on every TPU generation and in interpret mode alike.

`interpret=True` (the default off a TPU) runs either kernel with Pallas' TPU interpreter on any
backend (tests/unit/test_paged_decode.py holds them to the XLA references `paged_index_scores_xla`
and `sparse_mla_decode_xla` on the CPU). Design notes and TPU figures: docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from MaxText.kernels.backend import dot_precision, mosaic_block, pallas_interpret
from MaxText.kernels.fp8_blocks import (
  PAIR_GROUP,
  PAIRED_DTYPE,
  from_pairs,
  from_words,
  is_paired,
  natural_rows,
  quantize,
  take_slots,
)

NEG_INF = float("-inf")
FP8_BLOCK = 128  # elements per fp8 scale (kv_cache.FP8_BLOCK: kernels sit below inference)
_VALUES = {jnp.dtype(jnp.uint8): jnp.float8_e4m3fn, PAIRED_DTYPE: jnp.float8_e4m3fn,
           jnp.dtype(jnp.uint16): jnp.bfloat16}


def as_values(a: jax.Array) -> jax.Array:
  """The reference's decoding of a pool field (kv_cache.as_values): bits reinterpreted by XLA, not by
  the kernels' integer arithmetic, so the tests compare two decodings. uint32: fp8 codes 4 a word."""
  a = _bytes(a)
  value = _VALUES.get(jnp.dtype(a.dtype))
  return a if value is None else jax.lax.bitcast_convert_type(a, value)


def _bytes(a: jax.Array) -> jax.Array:
  """A pool field's rows with uint32 words (fp8 codes, 4 a word: fp8_blocks.to_words) as their uint8 codes,
  int32 words (bf16, 2 a word: fp8_blocks.to_pairs) as their uint16 bits."""
  if a.dtype == jnp.int32:
    return from_pairs(a)
  return from_words(a) if a.dtype == jnp.uint32 else a


# ---- bit decoding (the pools' integer storage -> f32), shared by both kernels

def e4m3_to_f32(bits: jax.Array) -> jax.Array:
  """float8_e4m3fn bits (any int dtype, values 0..255) -> f32 values, exactly (NaN -> NaN; the pools
  never hold one). t = the 7 bits of exponent e and mantissa m: normal (e >= 1) 2^(e-7) (1 + m/8) is t
  shifted into an f32's exponent and mantissa with the bias moved by 120; e = 0 (t < 8): 2^-6 m/8 = t 2^-9;
  the sign OR'd in last. 13 integer/float ops an element (the VPU's work in the scoring kernel)."""
  b = bits.astype(jnp.int32)
  if jnp.dtype(bits.dtype) != jnp.uint8:
    b = b & 0xFF
  t = b & 0x7F
  normal = jax.lax.bitcast_convert_type((t << 20) + (120 << 23), jnp.float32)
  mag = jnp.where(t < 8, t.astype(jnp.float32) * (2.0 ** -9), normal)
  mag = jnp.where(t == 0x7F, jnp.nan, mag)
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(mag, jnp.int32) | ((b & 0x80) << 24), jnp.float32)


def _bf16_bits_to_f32(bits: jax.Array) -> jax.Array:
  """bfloat16 bits (uint16 / int32 holding 0..65535) -> f32 values, exactly."""
  return jax.lax.bitcast_convert_type((bits.astype(jnp.int32) & 0xFFFF) << 16, jnp.float32)


def _decode(x: jax.Array) -> jax.Array:
  """A field as a pool stores it -> f32: uint8 = fp8 bits, uint16 = bf16 bits, a float as is."""
  if x.dtype == jnp.uint8:
    return e4m3_to_f32(x)
  if x.dtype == jnp.uint16:
    return _bf16_bits_to_f32(x)
  return x.astype(jnp.float32)


def _dequant(x: jax.Array, scale: jax.Array | None) -> jax.Array:
  """x [n, w] as stored, scale [n, ceil(w/128)] (fp8) or None -> [n, w] f32 values."""
  v = _decode(x)
  if scale is None:
    return v
  w = v.shape[-1]  # [n, w]; scale [n, ceil(w/128)]: lane-aligned 128-wide groups, no 3-D reshape (Mosaic)
  return jnp.concatenate([v[:, g:g + FP8_BLOCK] * scale[:, i:i + 1] for i, g in enumerate(range(0, w, FP8_BLOCK))],
                         axis=1)


# ---- double-buffered gathers: items `ids[i]` of pools in HBM into VMEM buffers (two slots each)

def _start_copies(fields, sems, ids_ref, slot, n: int) -> None:
  """Start the DMAs of block `slot`: for each of the n ids and each field (src [M, ...] in HBM, dst [2, n,
  ...] in VMEM), item ids_ref[0, 0, i] of src into dst[slot, i], all on the (slot, field) DMA semaphore."""
  @pl.loop(0, n)
  def _(i):
    item = ids_ref[0, 0, i]
    for f, (src, dst) in enumerate(fields):
      pltpu.make_async_copy(src.at[pl.ds(item, 1)], dst.at[slot, pl.ds(i, 1)], sems.at[slot, f]).start()


def _wait_copies(fields, sems, slot) -> None:
  """Wait for block `slot`'s DMAs: ONE wait per field, described as a copy of the whole dst[slot] (n items'
  bytes; a DMA semaphore counts bytes), not n waits in a scalar loop: on a v5e at 32 pages a block, 16 rows
  x 128K fp8 keys, the scoring call 2.77 -> 2.55 ms (docs/kernels.md)."""
  for f, (_, dst) in enumerate(fields):
    pltpu.make_async_copy(dst.at[slot], dst.at[slot], sems.at[slot, f]).wait()


def _pipelined(fields, sems, ids_now, ids_next, n: int, needed):
  """Within the second grid axis j (sequential per row), for a row that needs blocks 0 .. `needed` (a traced
  scalar; < 0: none): on return, where j <= needed, block j's items are in slot j % 2 of every dst and block j+1's
  DMAs (if needed) already started into the other slot (block 0's at j == 0). Blocks past `needed` are never
  read: a row shorter than the table reads only its own keys (every DMA started is waited for)."""
  j = pl.program_id(1)
  slot = j % 2

  @pl.when((j == 0) & (needed >= 0))
  def _():
    _start_copies(fields, sems, ids_now, 0, n)

  @pl.when(j < needed)
  def _():
    _start_copies(fields, sems, ids_next, 1 - slot, n)

  @pl.when(j <= needed)
  def _():
    _wait_copies(fields, sems, slot)

  return slot


def _ids_specs(width: int, n_blocks: int):
  """Two SMEM BlockSpecs of an id array laid out [B * n_blocks, 1, width] (`_blocked_ids`: a block's ids
  are a whole array row, as Mosaic wants a block's last two dims whole or tiled): this block's ids
  and the next one's (the last block's again at the end)."""
  return [pl.BlockSpec((1, 1, width), lambda b, j: (b * n_blocks + j, 0, 0), memory_space=pltpu.SMEM),
          pl.BlockSpec((1, 1, width), lambda b, j: (b * n_blocks + jnp.minimum(j + 1, n_blocks - 1), 0, 0),
                       memory_space=pltpu.SMEM)]


def _blocked_ids(ids: jax.Array, width: int) -> jax.Array:
  """ids [B, n*width] -> [B*n, 1, width] (`_ids_specs`' layout)."""
  return ids.astype(jnp.int32).reshape(-1, 1, width)


_NT = (((1,), (1,)), ((), ()))  # dot_general: [m,k] x [n,k] -> [m,n]
_HI = jax.lax.Precision.HIGHEST


# ---- (a) paged indexer scoring

def fp8_queries(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [..., H, d] (d = 128, after the Hadamard rotation) -> (e4m3 bits uint8 [..., H, d], scale [..., H]
  fp32): DeepSeek's per-128-block quantization (fp8_blocks.quantize with block (1, 128): scale =
  amax / 448), one block per head, as the release's indexer quantizes its queries for decode."""
  v = quantize(q.astype(jnp.float32), (1, FP8_BLOCK))
  return jax.lax.bitcast_convert_type(v.values, jnp.uint8), v.scale[..., 0]


def fp8_scored_queries(q: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The indexer's queries q [..., H, d] and head weights w [..., H] as every decode scoring path takes
  them with an fp8 indexer cache (the release's arithmetic: fp8_queries' e4m3 codes and per-128-block
  scales): d <= 128 (one block a head) -> (the codes' values as bf16 [..., H, d] (exact: e4m3 is a subset
  of bf16), w * scale [..., H]), since sum_h w relu((s c) . k) = sum_h (w s) relu(c . k) for s > 0; the
  kernel scores bf16 queries against fp8 keys in ONE MXU pass with exact products. d > 128: the
  dequantized queries (codes x their block's scale) in fp32, w unchanged."""
  d = q.shape[-1]
  v = quantize(q.astype(jnp.float32), (1, FP8_BLOCK))  # values [..., H, d] e4m3, scale [..., H, ceil(d/128)]
  if d <= FP8_BLOCK:
    return v.values.astype(jnp.bfloat16), w.astype(jnp.float32) * v.scale[..., 0]
  scale = jnp.repeat(v.scale, FP8_BLOCK, axis=-1)[..., :d]  # [..., H, d]
  return v.values.astype(jnp.float32) * scale, w


def index_weights(w: jax.Array, d: int) -> jax.Array:
  """w [B,H] (fp32, already times H**-0.5, as Indexer.queries) -> the per-head weights the kernel
  multiplies relu(q.k) by: w * d**-0.5 (index_scores' factor)."""
  return w.astype(jnp.float32) * d ** -0.5


def _split_bf16(x: jax.Array, parts: int = 3) -> list[jax.Array]:
  """f32 x -> bf16 parts whose sum is x to ~2^-24 relative (each the rounding of what the ones before
  left): a product with a bf16-exact operand (an fp8 key) is fp32-accurate in `parts` single MXU passes
  with an f32 accumulator, half of Precision.HIGHEST's six."""
  out = []
  for _ in range(parts):
    hi = x.astype(jnp.bfloat16)
    out.append(hi)
    x = x - hi.astype(jnp.float32)
  return out


def _bf16_logits(q: jax.Array, k16: jax.Array) -> jax.Array:
  """q [H, d] (bf16: one exact pass; uint8 fp8 bits; else fp32 in 3 bf16 parts) x bf16 keys [n, d] -> [H, n] fp32
  logits: the parts stacked [3H, d] in ONE dot (each key tile loaded into the MXU once for all three), their
  products summed in order."""
  if q.dtype == jnp.bfloat16:  # fp8_scored_queries' e4m3 values: one exact pass
    qs = [q]
  elif q.dtype == jnp.uint8:
    qs = [_decode(q).astype(jnp.bfloat16)]
  else:
    qs = _split_bf16(q.astype(jnp.float32))
  h = q.shape[0]
  both = jax.lax.dot_general(jnp.concatenate(qs, axis=0), k16, _NT, preferred_element_type=jnp.float32,
                             precision=dot_precision(k16.dtype))  # [3H, n]
  return sum(both[i * h:(i + 1) * h] for i in range(len(qs)))  # [H, n]


def _paired_bf16(words: jax.Array) -> list[jax.Array]:
  """A paired idx_k block's words [n/4, d] (rows 4i .. 4i+3 in bytes 0 .. 3: fp8_blocks.paired_rows) -> its two
  halves as bf16 keys [n/2, d] each: bytes 0 and 2 (every group's first 128 slots, in order), bytes 1 and 3 (its
  second 128). Each code's 7 magnitude bits go under a bf16's exponent (mantissa 3 bits down, exponent bias 0,
  not e4m3's 7) and its sign on top: the value times 2^-120, exactly, for every normal code (a paired pool holds
  no subnormal one); 9 word ops per 4 codes where e4m3_to_f32 and a bf16 pack took ~15 per code (the v5e's VPU was
  the scoring kernel's bound: docs/kernels.md). The caller's queries carry 2^60 and its weights 2^60 back."""
  mag, sign = jnp.uint32(0x07F007F0), jnp.uint32(0x80008000)
  first = ((words << 4) & mag) | ((words << 8) & sign)  # bytes 0, 2 -> the low, high bf16 of each word
  second = ((words >> 4) & mag) | (words & sign)  # bytes 1, 3
  return [pltpu.bitcast(half, jnp.bfloat16) for half in (first, second)]  # [n/2, d] each


PAIRED_Q_SCALE = 2.0 ** 60  # a paired kernel's query factor (its keys carry 2^-120; its weights carry 2^60)


def _score_kernel(pos_ref, tab_now, tab_next, q_ref, w_ref, k_hbm, out_ref, kbuf, sems, *, pages: int, page: int,
                  fp8: bool, paired: bool):
  b, j = pl.program_id(0), pl.program_id(1)
  width, d = pages * page, kbuf.shape[-1]
  needed = jnp.minimum(jax.lax.div(pos_ref[b] + width, width) - 1, pl.num_programs(1) - 1)  # the row's last block
  # with a key at or before its position, at most the table's last (pos >= -1: a non-negative numerator, so lax.div's
  # truncation floors; `//` lowers through sign, which Mosaic cannot lower without a TPU at hand)
  slot = _pipelined(((k_hbm, kbuf),), sems, tab_now, tab_next, pages, needed)

  @pl.when(j > needed)  # past the row's position: nothing read, every score -inf
  def _():
    out_ref[0] = jnp.full((1, width), NEG_INF, jnp.float32)

  @pl.when(j <= needed)
  def _():
    _score_block(kbuf, slot, q_ref, w_ref, out_ref, pos_ref[b], j, width=width, d=d, fp8=fp8, paired=paired)


def _score_block(kbuf, slot, q_ref, w_ref, out_ref, pos, j, *, width: int, d: int, fp8: bool, paired: bool):
  """One grid step's scores over the block in kbuf[slot] (_score_kernel's)."""
  keys, q = kbuf[slot].reshape(width, d), q_ref[0]  # [width, d], [H, d] as stored / given
  w = w_ref[0]  # [H,1] (q scales folded in)
  if paired:  # bf16 keys by word ops; each half's scores [1, width/2], then each group's two halves side by side
    halves = [jnp.sum(w * jnp.maximum(_bf16_logits(q, k16), 0.0), axis=0, keepdims=True)
              for k16 in _paired_bf16(pltpu.bitcast(keys, jnp.uint32))]  # [1, width/2] each
    g = PAIR_GROUP // 2
    scores = jnp.concatenate([half[:, i * g:(i + 1) * g] for i in range(width // PAIR_GROUP) for half in halves],
                             axis=1)  # [1, width]: whole 128-lane pieces
  else:
    if fp8:  # e4m3 -> bf16 is exact, and so are bf16 x bf16 products in the f32 accumulator
      logits = _bf16_logits(q, _decode(keys).astype(jnp.bfloat16))  # [H, width]
    else:  # fp32 keys and queries
      logits = jax.lax.dot_general(q.astype(jnp.float32), keys.astype(jnp.float32), _NT,
                                   preferred_element_type=jnp.float32, precision=_HI)  # [H, width]
    scores = jnp.sum(w * jnp.maximum(logits, 0.0), axis=0, keepdims=True)  # [1,width]
  slots = j * width + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
  out_ref[0] = jnp.where(slots <= pos, scores, NEG_INF)


def paged_index_scores(q: jax.Array, q_scale: jax.Array | None, w: jax.Array, idx_k: jax.Array,
                       idx_k_scale: jax.Array | None, table: jax.Array, pos: jax.Array, page: int, *,
                       pages_per_block: int = 8, interpret: bool | None = None) -> jax.Array:
  """Scores [B, P*page] fp32 of one query per row over its pages (the kernel; module doc):
  sum_h w[h] relu(q[h] . k[s]) with q, k the dequantized values.

  q [B,H,d]: f32 or bf16 (q_scale None; with fp8 keys a bf16 q is scored in one MXU pass, exact for
  fp8_scored_queries' e4m3 values, an f32 q in three), or with fp8 keys fp8 bits uint8 with q_scale [B,H]
  f32 (one scale per head's d = 128 values: fp8_queries); w [B,H] the per-head weights (index_weights); idx_k [N,d] as the pool holds it
  (uint8 fp8 bits with idx_k_scale [N,1], or f32); table [B,P] page ids (< 0: none, read as page 0
  and masked only by pos); pos [B] each row's query position: slots > pos score -inf. Blocks of
  pages_per_block pages, or as backend.mosaic_block makes them tileable (the table padded to whole blocks)."""
  fp8, paired = idx_k_scale is not None, is_paired(idx_k)
  b, h, d = q.shape
  p = table.shape[1]
  if fp8 and idx_k_scale.shape[-1] != 1:
    raise ValueError(f"paged_index_scores: fp8 keys need one scale per key (d = 128), got {idx_k_scale.shape}")
  if (q.dtype == jnp.uint8) != (q_scale is not None) or (q_scale is not None and not fp8):
    raise ValueError("paged_index_scores: fp8 queries (uint8 bits) come with q_scale, and with fp8 keys")
  if paired and (not fp8 or page % PAIR_GROUP):
    raise ValueError(f"paged_index_scores: a paired (int8) pool holds fp8 keys in pages of whole {PAIR_GROUP}-slot "
                     f"groups, got page {page}{'' if fp8 else ' and no scales'}")
  width, slots = mosaic_block(p * page, pages_per_block * page)  # a block's slots: 128 lanes, or every slot
  pages_per_block, n_blocks = width // page, slots // width
  table = jnp.pad(jnp.maximum(table, 0).astype(jnp.int32), ((0, 0), (0, slots // page - p)))  # [B, P'] whole blocks
  w = w.astype(jnp.float32) * (1.0 if q_scale is None else q_scale)  # relu(qs x) = qs relu(x): the q scale joins w
  if paired:  # the kernel's keys carry 2^-120 (_paired_bf16): 2^60 on the queries (exact), 2^60 on the weights
    qv = as_values(q).astype(jnp.bfloat16 if q.dtype != jnp.float32 else jnp.float32)  # uint8: e4m3 -> bf16, exact
    q, w = qv * jnp.asarray(PAIRED_Q_SCALE, qv.dtype), w * PAIRED_Q_SCALE
  ids = _blocked_ids(table, pages_per_block)  # [B*n_blocks, 1, pages_per_block]
  ins = [jnp.maximum(pos, -1).astype(jnp.int32), ids, ids, q, w[:, :, None], idx_k.reshape(-1, page, d)]  # w [B,H,1]; keys [N/page,page,d]
  any_ = pl.BlockSpec(memory_space=pl.ANY)
  in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), *_ids_specs(pages_per_block, n_blocks),
              pl.BlockSpec((1, h, d), lambda i, j: (i, 0, 0)), pl.BlockSpec((1, h, 1), lambda i, j: (i, 0, 0)), any_]
  scratch = [pltpu.VMEM((2, pages_per_block, page, d), idx_k.dtype), pltpu.SemaphoreType.DMA((2, 1))]
  kernel = functools.partial(_score_kernel, pages=pages_per_block, page=page, fp8=fp8, paired=paired)
  scores = pl.pallas_call(
      kernel, grid=(b, n_blocks), in_specs=in_specs,
      out_specs=pl.BlockSpec((1, 1, width), lambda i, j: (i, 0, j)),
      out_shape=jax.ShapeDtypeStruct((b, 1, slots), jnp.float32), scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pallas_interpret(interpret))(*ins)[:, 0, :p * page]  # [B, P*page]; fp8: without the keys' scales
  if not fp8:
    return scores
  # sum_h w relu(s q.k) = s sum_h w relu(q.k) for a key scale s > 0 (-inf stays -inf): the scales apply to the
  # kernel's scores here, a page row of `page` scales gathered per table entry ([N/page, page]: 2x lane padding at
  # page 64). Read in the kernel as a [page, 1] column they cost 32 KiB a page in HBM (the f32 (8, 128) tile's lane
  # padding, 4x the keys' bytes) and a relayout of the whole pool's scales each step (docs/kernels.md).
  scale_pages = idx_k_scale.astype(jnp.float32).reshape(-1, page)  # [N/page, page]
  scaled = scores * jnp.take(scale_pages, table[:, :p], axis=0).reshape(b, p * page)  # [B, P*page]
  return jnp.where(scores == NEG_INF, NEG_INF, scaled)  # a masked slot stays -inf whatever its scale (0 x -inf)


def paged_index_scores_xla(q, q_scale, w, idx_k, idx_k_scale, table, pos, page: int) -> jax.Array:
  """paged_index_scores' function in plain XLA (the reference): every page gathered, dequantized,
  scored in fp32."""
  b, h, d = q.shape
  keys = jnp.take(as_values(idx_k).astype(jnp.float32).reshape(-1, page, d), jnp.maximum(table, 0), axis=0)
  if is_paired(idx_k):  # a paired pool: each page's rows back in slot order
    keys = natural_rows(keys)  # [B,P,page,d]
  keys = keys.reshape(b, -1, d)  # [B,S,d]
  qv = as_values(q).astype(jnp.float32) * (1.0 if q_scale is None else q_scale[..., None])
  if idx_k_scale is not None:
    ks = jnp.take(idx_k_scale.reshape(-1, page), jnp.maximum(table, 0), axis=0).reshape(b, -1)  # [B,S]
    keys = keys * ks[..., None]
  logits = jnp.einsum("bhd,bsd->bhs", qv, keys, precision=jax.lax.Precision.HIGHEST)  # [B,H,S]
  scores = jnp.einsum("bhs,bh->bs", jax.nn.relu(logits), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  slots = jnp.arange(scores.shape[1], dtype=jnp.int32)[None]
  return jnp.where(slots <= pos[:, None], scores, NEG_INF)


# ---- (b) sparse MLA decode

def _mla_kernel(valid_ref, q_ref, qpe_ref, c_ref, pe_ref, *rest, scale: float, fp8: bool):
  if fp8:
    cs_ref, out_ref, m_ref, l_ref, acc_ref = rest
  else:
    cs_ref = None
    out_ref, m_ref, l_ref, acc_ref = rest
  j, last = pl.program_id(1), pl.num_programs(1) - 1

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, jnp.finfo(jnp.float32).min, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  c = _dequant(c_ref[0], None if cs_ref is None else cs_ref[0])  # [block, c] f32 (fp8: dequantized here)
  pe = _decode(pe_ref[0])  # [block, r]
  logits = (jax.lax.dot_general(q_ref[0], c, _NT, preferred_element_type=jnp.float32, precision=_HI)
            + jax.lax.dot_general(qpe_ref[0], pe, _NT, preferred_element_type=jnp.float32, precision=_HI)) * scale
  logits = jnp.where(valid_ref[0] > 0, logits, NEG_INF)  # [H, block]; valid [1, block]
  m_old = m_ref[...]  # [H,1]
  m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))  # finite: m starts at a finite floor
  p = jnp.exp(logits - m_new)  # [H, block]
  alpha = jnp.exp(m_old - m_new)
  l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
  acc_ref[...] = acc_ref[...] * alpha + jax.lax.dot_general(p, c, (((1,), (0,)), ((), ())),
                                                            preferred_element_type=jnp.float32, precision=_HI)
  m_ref[...] = m_new

  @pl.when(j == last)
  def _():
    out_ref[0] = acc_ref[...] / jnp.maximum(l_ref[...], jnp.finfo(jnp.float32).tiny)  # no valid slot: 0


def sparse_mla_decode(q_abs: jax.Array, q_pe: jax.Array, ids: jax.Array, valid: jax.Array, c_kv: jax.Array,
                      k_pe: jax.Array, c_kv_scale: jax.Array | None, scale: float, *, block: int = 256,
                      interpret: bool | None = None) -> jax.Array:
  """o_lat [B,H,c] fp32 = softmax over each row's valid selected slots of (q_abs.c + q_pe.pe) * scale,
  times c (module doc). q_abs [B,H,c], q_pe [B,H,r] f32; ids [B,K] slot ids of the pool (in blocks of
  `block`, or as backend.mosaic_block makes them tileable; invalid ones may hold anything), valid [B,K] bool; c_kv [N,c] as the pool holds
  it (uint8 fp8 bits with c_kv_scale [N, c/128] or its rows [N/R', R'*c/128], or f32), k_pe [N,r] (f32, or uint16
  bf16 bits, or int32 pairs [N/R, R*r/2]: paged_pools' rows). A
  row with no valid slot gets 0.

  The K selected rows are gathered AS STORED by XLA (B*K*(c + 2r + 16) bytes in fp8: 2048 rows of
  656 bytes a row, 1.3 MB), then the kernel streams them in blocks of `block` slots (Pallas'
  pipeline), dequantizes in VMEM and runs the online softmax. A per-slot DMA from the pool into a
  VMEM block (as the scoring kernel's per-page DMAs) did not lower from the 8-bit pool (Mosaic wanted
  the offset in the tiled dimension aligned to its 32 rows); from the 32-bit pools it lowers, but each
  DMA costs ~20-26 bundles to issue, no faster than XLA's row gather (docs/kernels.md)."""
  fp8 = c_kv_scale is not None
  b, h, c = q_abs.shape  # c_kv [N,c] (or uint32 words [N,c/4])
  r, k = q_pe.shape[-1], ids.shape[1]
  block, padded = mosaic_block(k, block)  # slots a grid step: 128 lanes (valid's block), or all k
  ids = jnp.pad(jnp.clip(ids, 0, c_kv.shape[0] - 1).astype(jnp.int32), ((0, 0), (0, padded - k)))  # [B,K']
  valid = jnp.pad(valid, ((0, 0), (0, padded - k)))  # [B,K']: the padding's slots are not valid
  k = padded
  pe = take_slots(k_pe, ids, c_kv.shape[0] // k_pe.shape[0])  # [B,K,r] (a packed pool: R slots a row)
  gathered = [_bytes(jnp.take(c_kv, ids, axis=0)), _bytes(pe)]  # [B,K,c], [B,K,r] as stored
  ins = [valid.astype(jnp.int32)[:, None], q_abs.astype(jnp.float32), q_pe.astype(jnp.float32), *gathered]
  in_specs = [pl.BlockSpec((1, 1, block), lambda i, j: (i, 0, j)), pl.BlockSpec((1, h, c), lambda i, j: (i, 0, 0)),
              pl.BlockSpec((1, h, r), lambda i, j: (i, 0, 0)), pl.BlockSpec((1, block, c), lambda i, j: (i, j, 0)),
              pl.BlockSpec((1, block, r), lambda i, j: (i, j, 0))]
  if fp8:
    ins.append(take_slots(c_kv_scale, ids, c_kv.shape[0] // c_kv_scale.shape[0]).astype(jnp.float32))  # [B,K,c/128]
    in_specs.append(pl.BlockSpec((1, block, c_kv_scale.shape[-1]), lambda i, j: (i, j, 0)))
  scratch = [pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, c), jnp.float32)]
  kernel = functools.partial(_mla_kernel, scale=scale, fp8=fp8)
  return pl.pallas_call(
      kernel, grid=(b, k // block), in_specs=in_specs,
      out_specs=pl.BlockSpec((1, h, c), lambda i, j: (i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, h, c), jnp.float32), scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pallas_interpret(interpret))(*ins)


def sparse_mla_decode_xla(q_abs, q_pe, ids, valid, c_kv, k_pe, c_kv_scale, scale: float) -> jax.Array:
  """sparse_mla_decode's function in plain XLA (the reference): the selected rows gathered,
  dequantized, a masked fp32 softmax."""
  ids = jnp.clip(ids, 0, c_kv.shape[0] - 1)
  c = as_values(jnp.take(c_kv, ids, axis=0)).astype(jnp.float32)  # [B,K,c]
  if c_kv_scale is not None:
    s = take_slots(c_kv_scale, ids, c_kv.shape[0] // c_kv_scale.shape[0])  # [B,K,c/128] (packed: R slots a row)
    c = (c.reshape(*c.shape[:2], -1, FP8_BLOCK) * s[..., None]).reshape(c.shape)
  pe = as_values(take_slots(k_pe, ids, c_kv.shape[0] // k_pe.shape[0])).astype(jnp.float32)  # [B,K,r]
  hi = jax.lax.Precision.HIGHEST
  logits = (jnp.einsum("bhc,bkc->bhk", q_abs, c, precision=hi)
            + jnp.einsum("bhr,bkr->bhk", q_pe, pe, precision=hi)) * scale  # [B,H,K]
  logits = jnp.where(valid[:, None], logits, NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(valid[:, None], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  out = jnp.einsum("bhk,bkc->bhc", p, c, precision=hi)
  return out / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


__all__ = ["e4m3_to_f32", "fp8_queries", "fp8_scored_queries", "paged_index_scores", "paged_index_scores_xla", "sparse_mla_decode", "sparse_mla_decode_xla",
           "index_weights"]
