"""DeepSeek's fp8 block-quantized weights: e4m3 values with one fp32 scale per block, the one place
that knows the per-block scale math (quantize, dequantize, shapes).

A weight W [..., K, N] (a kernel [in, out], or stacked experts [E, K, N]) with block (bk, bn) is held as

    values [..., K, N]                     float8_e4m3fn
    scale  [..., ceil(K/bk), ceil(N/bn)]   float32, W ~ values * scale of the value's block

as DeepSeek-V3's HF checkpoints hold it (`weight` + `weight_scale_inv`, 128 x 128 blocks; HF's
[out, in] layout is the transpose of ours, so its weight_block_size [b_out, b_in] is our (bn, bk)).
A dimension that is not a multiple of its block ends in a partial block (ceil), as in HF; blocks are
powers of 2, so the shapes alone say the block (`block_of`). The
quantization is DeepSeek's: scale = max|W| over the block / 448 (e4m3's largest finite value),
values = W / scale rounded to e4m3; an all-zero block gets scale 1.

`dequantize` is what every block-quantized linear and the MoE grouped matmul run right before their
matmul, inside the jitted step: values * scale in fp32, then the compute dtype (HF's and the official
weight_dequant's order), so no float copy of a weight outlives the op that uses it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from MaxText.kernels import backend

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


class BlockFP8(NamedTuple):
  """A block-quantized weight: values [..., K, N] e4m3, scale [..., ceil(K/bk), ceil(N/bn)] fp32."""
  values: jax.Array
  scale: jax.Array


def scale_shape(shape: tuple, block: tuple[int, int]) -> tuple:
  """The scale's shape for a weight of `shape` [..., K, N] and block (bk, bn): ceil over the last two axes."""
  *lead, k, n = shape
  return (*lead, math.ceil(k / block[0]), math.ceil(n / block[1]))


def block_of(values_shape: tuple, scale_shape_: tuple) -> tuple[int, int]:
  """The block (bk, bn) from the shapes: the power of 2 >= ceil(K / blocks), exact because blocks are
  powers of 2 (weight_block_size is validated so) and only the last block may be partial."""
  return tuple(1 << (math.ceil(d / nb) - 1).bit_length() for d, nb in zip(values_shape[-2:], scale_shape_[-2:]))


def dequantize(w: BlockFP8, dtype=jnp.float32, block: tuple[int, int] | None = None) -> jax.Array:
  """values [..., K, N] * their blocks' scales, in fp32, then cast to dtype -> [..., K, N]. block (bk, bn):
  given when a slice of rows makes the shapes ambiguous (`matmul`'s chunks), else read from the shapes."""
  k, n = w.values.shape[-2:]
  bk, bn = block or block_of(w.values.shape, w.scale.shape)
  s = jnp.repeat(jnp.repeat(w.scale.astype(jnp.float32), bk, axis=-2), bn, axis=-1)[..., :k, :n]  # [...,K,N]
  return (w.values.astype(jnp.float32) * s).astype(dtype)


def quantize(w: jax.Array, block: tuple[int, int]) -> BlockFP8:
  """w [..., K, N] float -> BlockFP8 with block (bk, bn): per block scale = max|w| / 448, values = w / scale."""
  *lead, k, n = w.shape
  bk, bn = block
  nk, nn = math.ceil(k / bk), math.ceil(n / bn)
  w = w.astype(jnp.float32)
  pad = [(0, 0)] * len(lead) + [(0, nk * bk - k), (0, nn * bn - n)]
  blocks = jnp.pad(w, pad).reshape(*lead, nk, bk, nn, bn)  # [...,nk,bk,nn,bn], zero padding
  amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))  # [...,nk,nn]
  scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)  # [...,nk,nn]
  values = (blocks / scale[..., :, None, :, None]).reshape(*lead, nk * bk, nn * bn)[..., :k, :n]  # [...,K,N]
  return BlockFP8(jnp.clip(values, -FP8_MAX, FP8_MAX).astype(FP8), scale)


def dequantize_if(w, dtype) -> jax.Array:
  """A float weight cast to dtype, or a BlockFP8 dequantized into it: the one entry every matmul uses."""
  return dequantize(w, dtype) if isinstance(w, BlockFP8) else w.astype(dtype)


def take(w, idx):
  """Rows `idx` of the leading (expert) axis of a float weight or of both parts of a BlockFP8."""
  if isinstance(w, BlockFP8):
    return BlockFP8(w.values[idx], w.scale[idx])
  return w[idx]


def shape_of(w) -> tuple:
  """The weight's logical shape [..., K, N], quantized or not."""
  return tuple((w.values if isinstance(w, BlockFP8) else w).shape)


MATMUL_CHUNKS = 8  # a block-quantized matmul dequantizes at most ~K/8 rows of its weight at a time


def matmul(x: jax.Array, w, dtype, precision=None, out_dtype=None) -> jax.Array:
  """x [..., K] @ w [K, N] in dtype -> [..., N] in out_dtype (default dtype; fp32: the accumulation itself,
  not rounded to dtype, for a LoRA delta to be added before the one rounding: kernels/low_rank.py). A float w:
  one einsum. A BlockFP8 w: dequantized one chunk of whole K-blocks at a time (about K / MATMUL_CHUNKS rows,
  cut at block boundaries), each chunk's product accumulated in fp32, so no float copy of the whole weight
  exists at once (the QLoRA base: DeepSeek's e4m3 + scales stay as they are in memory). Equals
  x @ dequantize(w) up to the order of the K-sum."""
  if not isinstance(w, BlockFP8):
    y = jnp.einsum("...i,io->...o", x.astype(dtype), w.astype(dtype), precision=precision,
                   preferred_element_type=out_dtype)  # [..., N]
    return rows_major_if_few(y, w.shape[-2])
  k = w.values.shape[-2]
  block = block_of(w.values.shape, w.scale.shape)
  nk = w.scale.shape[-2]  # K-blocks
  per = math.ceil(nk / MATMUL_CHUNKS)  # K-blocks per chunk (the last may have fewer)
  x = x.astype(dtype)
  y = None
  for j in range(0, nk, per):
    rows = slice(j * block[0], min(k, (j + per) * block[0]))
    wc = dequantize(BlockFP8(w.values[rows], w.scale[j:j + per]), dtype, block)  # [rows, N]
    part = jnp.einsum("...i,io->...o", x[..., rows], wc, precision=precision,
                      preferred_element_type=jnp.float32)  # [..., N] fp32
    y = part if y is None else y + part
  return rows_major_if_few(y.astype(out_dtype or dtype), k)


def rows_major_if_few(y: jax.Array, k: int) -> jax.Array:
  """A matmul's output y [..., N] (of a weight [K, N]) pinned row-major where it has fewer rows than the weight
  (prod(y.shape[:-1]) < K): a decode step's. Left free, XLA's TPU layout assignment gave the q projections'
  M = 16 outputs their heads minor and so relaid out the WEIGHT every step, a whole-weight copy (wq_b's 75.5 MB,
  0.33 ms, and the indexer's wq_b, 25 MB, in the 16-row 128K step: decode_profile --compile-for); pinned, any
  relayout is of the output, the smaller. backend.py's matmul_layout: the tpu row's (on the CPU the constraint
  cost the 4-row 128K decode step ~8 ms: XLA:CPU fuses less around it)."""
  if math.prod(y.shape[:-1]) >= k or backend.choice("matmul_layout") != "few_rows_pinned":
    return y
  return with_layout_constraint(y, Layout(major_to_minor=tuple(range(y.ndim))))


# ---- fp8 codes packed 4 to a 32-bit word (paged pools: inference/paged_cache.py)

WORD_CODES = 4  # e4m3 codes a uint32 word holds


def to_words(codes: jax.Array) -> jax.Array:
  """e4m3 codes [..., n] (float8_e4m3fn or their uint8 bits; n a multiple of 4) -> uint32 words [..., n/4].
  A TPU tiles an 8-bit [N, 512] array (32, 128) and a row gather or scatter wants (8, 128): XLA copied the
  whole fp8 latent pool into the other tiling twice a decode step (docs/kernels.md); as 32-bit words the
  rows are lane-dense (8, 128) tiles that a row gather reads and a scatter writes in place.

  The codes' order in the words is backend.py's fp8_unpack (written and read under the same row):
  "bitcast" (cpu): word i holds codes 4i .. 4i+3, unpacked by viewing the words as bytes (XLA:CPU fuses that
  view into the dequantization; the strided order cost its 4-row 128K decode step's merge 22 vs 2.3 ms).
  "shifts" (tpu): strided, with w = n/4 word i holds codes i, w + i, 2w + i, 3w + i (byte j, from the least
  significant: code j*w + i), so unpacking is 4 shifts and a concatenation of whole [..., w] pieces, and at
  n = 512 piece j is the latent's 128-block j; adjacent codes made the TPU's unpacking a lane interleave (XLA
  wrote the 16-row 128K step's gathered words out as u32[16,2048,128,4], 67 MB: decode_profile --compile-for)."""
  bits = codes if codes.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(codes.astype(FP8), jnp.uint8)
  if backend.choice("fp8_unpack") != "shifts":
    return jax.lax.bitcast_convert_type(bits.reshape(*bits.shape[:-1], -1, WORD_CODES), jnp.uint32)  # [..., n/4]
  w = bits.shape[-1] // WORD_CODES
  words = bits[..., :w].astype(jnp.uint32)  # [..., w]: byte 0
  for j in range(1, WORD_CODES):
    words = words | (bits[..., j * w:(j + 1) * w].astype(jnp.uint32) << (8 * j))  # [..., w]: byte j
  return words


def word_bytes(words: jax.Array) -> list[jax.Array]:
  """uint32 words [..., w] -> byte j of every word, j = 0 .. 3 (least significant first): WORD_CODES uint8 [..., w]
  pieces; under fp8_unpack "shifts" piece j holds codes j*w .. (j+1)*w - 1 (to_words)."""
  return [((words >> (8 * j)) & 0xFF).astype(jnp.uint8) for j in range(WORD_CODES)]


def from_words(words: jax.Array) -> jax.Array:
  """uint32 words [..., w] (to_words') -> their e4m3 codes' uint8 bits [..., 4w], in the codes' order (to_words'
  fp8_unpack: the words viewed as bytes, or byte j of every word, the 4 pieces concatenated)."""
  if backend.choice("fp8_unpack") == "shifts":
    return jnp.concatenate(word_bytes(words), axis=-1)
  bits = jax.lax.bitcast_convert_type(words, jnp.uint8)  # [..., w, 4]
  return bits.reshape(*words.shape[:-1], words.shape[-1] * WORD_CODES)


# ---- bf16 values packed 2 to a 32-bit word, and pools whose 128-word rows hold several slots

PAIR_VALUES = 2  # bf16 values an int32 word holds


def to_pairs(bits: jax.Array) -> jax.Array:
  """bf16 bits uint16 [..., n] (n even) -> int32 words [..., n/2] (the dtype says "bf16 pairs", as uint32 says
  "fp8 codes"). A TPU lays a narrow 16-bit [N, 64] pool out column-major and copied it whole into rows for
  each decode step's row gather (1.27 of 10.3 ms at 16 rows x 128K, docs/kernels.md); as words in lane-dense
  rows (`take_slots`) it is gathered where it lies. Strided as to_words: with w = n/2, word i holds values i (low
  half) and w + i (high half), so from_pairs is a shift, a mask and a concatenation (adjacent values a word made
  it an interleave: XLA wrote the 16-row step's gathered k_pe out as u32[16,2048,32,2]: --compile-for)."""
  w = bits.shape[-1] // PAIR_VALUES
  words = bits[..., :w].astype(jnp.uint32) | (bits[..., w:].astype(jnp.uint32) << 16)  # [..., w]
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def from_pairs(words: jax.Array) -> jax.Array:
  """int32 words [..., w] (to_pairs') -> their bf16 bits uint16 [..., 2w], in the values' order."""
  u = jax.lax.bitcast_convert_type(words, jnp.uint32)
  return jnp.concatenate([(u & 0xFFFF).astype(jnp.uint16), (u >> 16).astype(jnp.uint16)], axis=-1)


PICK_SELECTS = 4  # take_slots picks a slot out of rows of up to this many slots by selects, of more by a masked sum


def take_slots(pool: jax.Array, ids: jax.Array, per_row: int) -> jax.Array:
  """pool [N / per_row, per_row * w] (per_row slots of w words a row, slot s in row s // per_row at words
  (s % per_row) * w ..), ids [...] slot ids (clipped into the pool) -> [..., w] as stored. per_row 1: a
  plain row gather. Rows are gathered whole (lane-dense: no relayout of the pool), then each id's slot
  is picked out of its gathered row by per_row - 1 selects over static lane slices: elementwise, where a
  take_along_axis was a second gather (on a v5e each gathered index costs ~8-10 ns whatever its row's width:
  the k_pe pick was 0.44 ms of a 16-row 128K step, docs/kernels.md)."""
  if per_row == 1:
    return jnp.take(pool, ids, axis=0, mode="clip")  # [..., w]
  ids = jnp.clip(ids, 0, pool.shape[0] * per_row - 1)
  rows = jnp.take(pool, ids // per_row, axis=0, mode="clip")  # [..., per_row * w]
  return pick_slot(rows, ids, per_row)


def pick_slot(rows: jax.Array, ids: jax.Array, per_row: int) -> jax.Array:
  """rows [..., per_row * w] gathered pool rows, ids [...] the slot each was gathered for -> [..., w]: slot
  id % per_row's words, by per_row - 1 selects over static lane slices, or (past PICK_SELECTS slots a row) the
  row masked to its slot and summed (one term not 0: exact). take_slots' pick, for any rows of per_row slots."""
  w, part = rows.shape[-1] // per_row, (ids % per_row)[..., None]  # part [..., 1]: the slot's place in its row
  if per_row > PICK_SELECTS:  # narrow slots, many a row (the latent's scales)
    hit = jnp.arange(per_row, dtype=part.dtype) == part  # [..., R]: one True
    lanes = rows.reshape(*rows.shape[:-1], per_row, w)  # [..., R, w]
    return jnp.sum(jnp.where(hit[..., None], lanes, 0), axis=-2, dtype=rows.dtype)
  out = rows[..., :w]  # [..., w]
  for p in range(1, per_row):
    out = jnp.where(part == p, rows[..., p * w:(p + 1) * w], out)
  return out


# ---- fp8 indexer keys in paired order (a paged idx_k pool held as int8: paged_cache.py, paged_decode.py)

PAIR_GROUP = 256  # slots whose pool rows a paired idx_k pool orders among themselves (a page holds whole groups)
PAIRED_DTYPE = jnp.dtype(jnp.int8)  # a paired pool's dtype: the one mark of the order (uint8 pools are in slot order)


def is_paired(pool: jax.Array) -> bool:
  """Whether a pool (or a block of it) holds its rows in paired order: its dtype says so (PAIRED_DTYPE)."""
  return jnp.dtype(pool.dtype) == PAIRED_DTYPE


def paired_rows(slots: jax.Array) -> jax.Array:
  """Slot ids [...] -> the pool rows that hold them in paired order. Within each group of PAIR_GROUP slots
  (g = the group's first slot), slot g + o with o = half * 128 + 2 i + h (half, h in {0, 1}, i < 64) lies in row
  g + 4 i + 2 h + half. Viewed as 32-bit words (4 rows a word, row 4i + j in byte j, as Mosaic's bitcast of an
  8-bit [n, 128] block to [n/4, 128] words), bytes 0 and 2 of word i hold slots 2i and 2i + 1 of the group's
  first half and bytes 1 and 3 those of its second half: two shifts and masks make each half's codes bf16 pairs
  in slot order (paged_decode's scoring kernel), with no unpacking to 32-bit lanes. Slots past a whole number
  of groups (the pool's drop slot N, N a multiple of PAIR_GROUP) map to themselves."""
  o = slots % PAIR_GROUP
  lo = o % 128
  return slots - o + 4 * (lo // 2) + 2 * (lo % 2) + o // 128


def natural_rows(x: jax.Array, axis: int = -2) -> jax.Array:
  """x [..., m * PAIR_GROUP, ...] rows of whole groups in paired order (axis `axis`) -> the same rows in slot
  order (paired_rows' inverse): a group's stored rows indexed (i, h, half) are its slots (half, i, h)."""
  axis = axis % x.ndim
  n = x.shape[axis]
  g = x.reshape(*x.shape[:axis], n // PAIR_GROUP, 64, 2, 2, *x.shape[axis + 1:])  # [.., m, i, h, half, ..]
  g = jnp.moveaxis(g, axis + 3, axis + 1)  # [.., m, half, i, h, ..]
  return g.reshape(x.shape)


def flush_subnormals(bits: jax.Array) -> jax.Array:
  """e4m3 bits (uint8 / int8) -> the same with every subnormal code (exponent bits 0: |value| < 2^-6, below
  the smallest normal) made a zero of its sign. A paired pool holds its keys so: its kernel decodes a code
  into a bf16 exponent by shifts alone, where a subnormal would be a bf16 denormal, which a TPU flushes
  (and XLA:CPU does in a dot): flushed here, every backend reads the same values. Within a block scaled
  to amax / 448 such a code is below amax * 2^-6 / 448 = amax * 3.5e-5."""
  u = jax.lax.bitcast_convert_type(bits, jnp.uint8) if bits.dtype == jnp.int8 else bits
  u = jnp.where((u & 0x78) == 0, u & 0x80, u)
  return jax.lax.bitcast_convert_type(u, jnp.int8) if bits.dtype == jnp.int8 else u
