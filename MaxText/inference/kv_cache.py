"""What the decode caches store for MLA + the lightning indexer, and the contiguous store.

Per layer and per token the cache holds only what attention reads back, never per-head keys
or values (MaxText's MLA cache expands those: h*(nope+v) numbers a token instead of these):

    c_kv   [kv_lora_rank]       the kv_norm'ed latent; keys and values are wkv_b of it
    k_pe   [qk_rope_head_dim]   the RoPE'd rotary key, shared by all heads
    idx_k  [indexer_head_dim]   the lightning indexer's key (LayerNorm'ed, RoPE'd), one per token

The serving engine stores them in paged pools (paged_cache.py: the same fields and dtypes, one
slot per token) and reads them back through a `LayerCache` view of each row's sequence. The
contiguous store here (`init_layer_cache`, `write`, `gather_latents`) is the same format laid out
per row: a `LayerCache` of arrays [L, b, S, n] for a scanned layer stack or [b, S, n] for one layer;
which positions hold real tokens is the caller's business, the cache is just storage: `write`
stores new entries in place, a step only reads (one program that did both made XLA:CPU copy the
whole cache: kernels/cached_attention.py).
The indexer keys are stored transposed, [.., b, d, S] (positions minor): every step multiplies
the whole key cache by the indexer queries, q [h,d] x k^T [d,S], and with this layout the matmul
reads the cache in place; a [S,d] layout made XLA:CPU transpose all of it first, every step
(benchmarks/decode.py; docs/measured_choices.md). c_kv and k_pe stay [S, n]: a step gathers whole rows of them.

kv_cache_dtype:
  float32 / bfloat16  every vector stored in that dtype.
  fp8                 as DeepSeek's deployment (the official inference code simulates it; FlashMLA's
                      fp8 cache stores the same bytes): c_kv and idx_k in float8_e4m3fn with one fp32
                      scale per 128-element block of each vector (scale = block amax / 448), k_pe
                      in bfloat16 (the rotary dims stay unquantized). Dequantized on read.
Bytes per token per layer: (kv_lora + rope + idx) * itemsize, or for fp8
kv_lora + 4 * ceil(kv_lora/128) + 2 * rope + idx + 4 * ceil(idx/128) (788 for the 671B model).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config.types import Config
from MaxText.kernels import backend
from MaxText.kernels.fp8_blocks import (
  PAIR_VALUES,
  PAIRED_DTYPE,
  WORD_CODES,
  flush_subnormals,
  from_pairs,
  from_words,
  to_pairs,
  to_words,
  word_bytes,
)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # elements per quantization scale


class LayerCache(NamedTuple):
  """One layer's cache ([b,S,n] leaves) or a scanned stack's ([L,b,S,n]); None leaves are absent."""
  c_kv: jax.Array                      # [(L,) b, S, kv_lora]
  k_pe: jax.Array                      # [(L,) b, S, rope]
  idx_k: jax.Array | None = None       # [(L,) b, indexer_head_dim, S] (transposed); None without the indexer
  c_kv_scale: jax.Array | None = None  # [(L,) b, S, ceil(kv_lora/128)] fp32; fp8 only
  idx_k_scale: jax.Array | None = None  # [(L,) b, ceil(indexer_head_dim/128), S] fp32; fp8 only


# ---------------------------------------------------------------- fp8 blocks


def quantize_fp8(x: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
  """x [..., n] -> (q [..., n] float8_e4m3fn, scale [..., ceil(n/block)] fp32), x ~ q * scale blockwise.

  scale = amax(|block|) / 448 (an all-zero block gets scale 1 and stays exactly 0). Values are
  clipped to +-448 before the cast: float8_e4m3fn has no infinity, an overflow would be NaN.
  """
  n = x.shape[-1]
  nb = -(-n // block)
  xf = x.astype(jnp.float32)
  xb = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)]).reshape(*x.shape[:-1], nb, block)
  amax = jnp.max(jnp.abs(xb), axis=-1)  # [..., nb]
  scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  q = jnp.clip(xb / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)  # [..., nb, block]
  return q.reshape(*x.shape[:-1], nb * block)[..., :n], scale


def e4m3_values(q: jax.Array) -> jax.Array:
  """q float8_e4m3fn (or its uint8 bits) -> f32, exactly, by XLA's convert (NaN codes 0x7F / 0xFF -> NaN).
  The one decode of the XLA paths; the Pallas kernels decode the same bits with integer ops
  (paged_decode.e4m3_to_f32), equal for all 256 codes (tests/unit/test_kv_cache.py). Those integer ops and
  a 256-entry table were measured as alternatives here and cost the same (docs/kernels.md, On the CPU)."""
  return as_values(q).astype(jnp.float32)


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32, block: int = FP8_BLOCK) -> jax.Array:
  """(q [..., n] float8_e4m3fn (or its uint8 bits), scale [..., ceil(n/block)]) -> [..., n] in dtype.
  backend.py's fp8_unpack "bitcast" (cpu, portable): the codes viewed [..., nb, block] times the scales (what XLA:CPU
  fuses best). "shifts" (tpu): each block a slice of whole lanes times its scale column, the slices concatenated: no [..., nb, block] view,
  which a TPU tiles (8, 128) over nb (4 padded to 8) and so wrote the scales out broadcast, f32[16,2048,4,128]
  (67 MB) in the 16-row 128K decode step (decode_profile --compile-for). q may be the pool's uint32 words
  (fp8_blocks.to_words, [..., n/4]): where a word piece holds whole blocks (n/4 a multiple of block: the 512-wide
  latent) each block is decoded from its piece's byte directly, never the [..., n] codes in between (XLA wrote
  those out, f32[16,2048,512], to slice them)."""
  nb = scale.shape[-1]
  if backend.choice("fp8_unpack") != "shifts":  # the CPU's: the codes viewed [..., nb, block] times their scales
    v = e4m3_values(q)  # [..., n] f32 (words unpacked by from_words' view)
    n = v.shape[-1]
    vb = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, nb * block - n)]).reshape(*v.shape[:-1], nb, block)
    return (vb * scale[..., None]).reshape(*v.shape[:-1], nb * block)[..., :n].astype(dtype)
  if q.dtype == jnp.uint32 and q.shape[-1] % block == 0:  # piece j = codes [j*w, (j+1)*w): whole blocks
    pieces = word_bytes(q)  # [..., w] bits each
  else:
    pieces = [as_values(q)]  # [..., n]
  parts, start = [], 0
  for piece in pieces:
    v = e4m3_values(piece)  # [..., w] f32
    for lo in range(0, v.shape[-1], block):
      i = (start + lo) // block
      parts.append(v[..., lo:lo + block] * scale[..., i:i + 1])  # [..., <= block]
    start += v.shape[-1]
  assert len(parts) == nb, (q.shape, scale.shape)
  return jnp.concatenate(parts, axis=-1).astype(dtype)  # [..., n]


# ---------------------------------------------------------------- layout and sizes


def field_dtypes(kv_cache_dtype: str):
  """(latent dtype for c_kv and idx_k, rotary dtype for k_pe)."""
  if kv_cache_dtype == "fp8":
    return FP8, jnp.bfloat16
  dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[kv_cache_dtype]
  return dt, dt


def field_widths(config: Config) -> dict[str, int]:
  """Width of each cached vector per token (0 = not stored)."""
  fp8 = config.kv_cache_dtype == "fp8"
  idx = config.indexer_head_dim if config.use_indexer else 0
  return {"c_kv": config.kv_lora_rank, "k_pe": config.qk_rope_head_dim, "idx_k": idx,
          "c_kv_scale": -(-config.kv_lora_rank // FP8_BLOCK) if fp8 else 0,
          "idx_k_scale": -(-idx // FP8_BLOCK) if fp8 and idx else 0}


_TRANSPOSED = ("idx_k", "idx_k_scale")  # stored [.., b, n, S]


def init_layer_cache(config: Config, batch: int, num_layers: int | None = None,
                     length: int | None = None) -> LayerCache:
  """Zeros [num_layers, batch, S, n] (or [batch, S, n] when num_layers is None), S = length or
  max_target_length; the indexer's arrays [.., batch, n, S]."""
  latent, rotary = field_dtypes(config.kv_cache_dtype)
  layers = () if num_layers is None else (num_layers,)
  s = length or config.max_target_length
  dt = {"c_kv": latent, "k_pe": rotary, "idx_k": latent, "c_kv_scale": jnp.float32, "idx_k_scale": jnp.float32}
  shape = lambda name, w: layers + (batch,) + ((w, s) if name in _TRANSPOSED else (s, w))
  return LayerCache(**{name: jnp.zeros(shape(name, w), dt[name]) if w else None
                       for name, w in field_widths(config).items()})


def bytes_per_token_per_layer(config: Config) -> int:
  """Bytes one token costs in one layer's cache, scales included."""
  latent, rotary = field_dtypes(config.kv_cache_dtype)
  size = {"c_kv": latent, "k_pe": rotary, "idx_k": latent, "c_kv_scale": jnp.float32, "idx_k_scale": jnp.float32}
  return sum(w * jnp.dtype(size[name]).itemsize for name, w in field_widths(config).items())


# ---------------------------------------------------------------- write and read


_BITS = {jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8), jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
_VALUES = {**{bits: value for value, bits in _BITS.items()}, jnp.dtype(jnp.uint32): jnp.dtype(FP8),
           jnp.dtype(jnp.int32): jnp.dtype(jnp.bfloat16), PAIRED_DTYPE: jnp.dtype(FP8)}
_PER_WORD = {jnp.dtype(jnp.uint32): WORD_CODES, jnp.dtype(jnp.int32): PAIR_VALUES}  # values a 32-bit word holds
WORD_ROW = 512  # fp8 values a pool row must be a multiple of to be held as uint32 words (one 128-lane row)


def storage_dtype(dtype, width: int | None = None, pairs: bool = False) -> jnp.dtype:
  """The dtype a paged pool (paged_cache.py) holds for values of `dtype`: fp8 / bf16 as uint8 / uint16
  (their bits; XLA:CPU rewrites a whole float8/bfloat16 array to update it, an integer one it updates
  in place), else itself. fp8 of a `width` that fills whole 512-byte rows (the 512-wide latent) as uint32
  words, 4 codes each (fp8_blocks.to_words: a TPU gathers and scatters rows of a lane-dense 32-bit array
  in place, not of an 8-bit [N, 512] one). bf16 of an even `width` with `pairs` (paged_cache's k_pe under
  backend.py's rope_storage "rows") as int32 words, 2 values each (fp8_blocks.to_pairs). The contiguous
  LayerCache holds the values' dtypes themselves. (int8, not chosen here: paged_cache's fp8 idx_k in paired
  row order, subnormal codes flushed: fp8_blocks.paired_rows.)"""
  if jnp.dtype(dtype) == FP8 and width is not None and width % WORD_ROW == 0:
    return jnp.dtype(jnp.uint32)
  if pairs and jnp.dtype(dtype) == jnp.bfloat16 and width is not None and width % PAIR_VALUES == 0:
    return jnp.dtype(jnp.int32)
  return _BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))


def storage_width(dtype, width: int, pairs: bool = False) -> int:
  """A slot's width in the pool for `width` values of `dtype` (storage_dtype's: width / 4 as uint32 words,
  width / 2 as int32 pairs)."""
  return width // _PER_WORD.get(storage_dtype(dtype, width, pairs), 1)


def value_width(a: jax.Array) -> int:
  """The values a pool row of `a` holds (storage_width's inverse: 4 a uint32 word, 2 an int32 one)."""
  return a.shape[-1] * _PER_WORD.get(jnp.dtype(a.dtype), 1)


def value_dtype(dtype) -> jnp.dtype:
  """The values' dtype of a field held in `dtype` (storage_dtype's inverse: uint32 words hold fp8; any
  dtype but uint8/16/32: itself)."""
  return _VALUES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def as_values(a: jax.Array) -> jax.Array:
  """A field's (or a block read from it) values: fp8 / bf16 bits reinterpreted, never converted; uint32
  words [..., w] unpacked to their fp8 values [..., 4w], int32 words to their bf16 values [..., 2w]."""
  if a.dtype == jnp.uint32:
    a = from_words(a)
  elif a.dtype == jnp.int32:
    a = from_pairs(a)
  value = value_dtype(a.dtype)
  return a if value == a.dtype else jax.lax.bitcast_convert_type(a, value)


def to_storage(x: jax.Array, dtype) -> jax.Array:
  """Values x as a field held in `dtype` holds them: cast to its values' dtype, then as bits where it holds
  bits (uint32: packed 4 codes a word, [..., n] -> [..., n/4]; int32: 2 bf16 a word, [..., n/2])."""
  x = x.astype(value_dtype(dtype))
  if jnp.dtype(dtype) == jnp.uint32:
    return to_words(x)
  if jnp.dtype(dtype) == PAIRED_DTYPE:  # a paired pool's codes (paged_cache.py): subnormals flushed
    return flush_subnormals(jax.lax.bitcast_convert_type(x, PAIRED_DTYPE))
  if jnp.dtype(dtype) == jnp.int32:
    return to_pairs(jax.lax.bitcast_convert_type(x, jnp.uint16))
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def as_fields(store, **given) -> dict:
  """The new vectors {c_kv, k_pe, idx_k} (None: not given) as the store's fields hold them: an fp8
  field quantized, its scales as the `<name>_scale` field (k_pe is never quantized). `store` is a
  LayerCache or a paged_pools.PagedLayerCache (the same field names)."""
  new = {}
  for name, x in given.items():
    if x is None:
      continue
    if name != "k_pe" and value_dtype(getattr(store, name).dtype) == FP8:
      new[name], new[name + "_scale"] = quantize_fp8(x)
    else:
      new[name] = x
  return new


def write(cache: LayerCache, start: jax.Array, *, c_kv: jax.Array | None = None, k_pe: jax.Array | None = None,
          idx_k: jax.Array | None = None) -> LayerCache:
  """Stores t new tokens per row at positions start[b] .. start[b]+t-1 (ragged rows: each its own start).

  cache [.., b, S, n] (a layer, or a stack with a leading L axis: every layer at once); the new
  vectors [.., b, t, n] with the same leading axes: c_kv, k_pe, idx_k (None: left as is; fp8
  fields are quantized here). One dynamic_update_slice per row and field: in place under jit with
  a donated cache (a scatter, or its out-of-bounds select, made XLA:CPU copy the whole cache).
  The window must fit, start + t <= S (dynamic_update_slice would move it back over real tokens):
  the caller sizes the cache to whole windows.
  """
  new = as_fields(cache, c_kv=c_kv, k_pe=k_pe, idx_k=idx_k)
  start = start.astype(jnp.int32)
  zero = jnp.zeros((), jnp.int32)

  def put(name, dst, upd):  # dst [.., b, S, n] ([.., b, n, S] transposed), upd [.., b, t, n]
    upd = upd.astype(dst.dtype)
    lead = (zero,) * (dst.ndim - 3)
    if name in _TRANSPOSED:
      upd = jnp.swapaxes(upd, -1, -2)  # [.., b, n, t]
    for i in range(dst.shape[-3]):  # rows
      at = lead + ((jnp.int32(i), zero, start[i]) if name in _TRANSPOSED else (jnp.int32(i), start[i], zero))
      dst = jax.lax.dynamic_update_slice(dst, upd[..., i:i + 1, :, :], at)
    return dst

  return cache._replace(**{name: put(name, getattr(cache, name), v) for name, v in new.items()})


def as_stored(cache: LayerCache, name: str, x: jax.Array, dtype=jnp.float32) -> jax.Array:
  """x [..., n] as the cache field `name` would give it back after a write and a read (rounded to
  the storage dtype; fp8: quantized and dequantized), in dtype."""
  stored = value_dtype(getattr(cache, name).dtype)
  if stored == FP8:
    return dequantize_fp8(*quantize_fp8(x), dtype)
  return x.astype(stored).astype(dtype)


def read_latents(view: LayerCache, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """A layer view -> c_kv [b,S,kv_lora], k_pe [b,S,rope] in dtype (dequantized for fp8)."""
  if view.c_kv_scale is not None:
    c_kv = dequantize_fp8(view.c_kv, view.c_kv_scale, dtype)
  else:
    c_kv = view.c_kv.astype(dtype)
  return c_kv, view.k_pe.astype(dtype)


def read_indexer_keys(view: LayerCache, dtype=jnp.float32) -> jax.Array:
  """A layer view -> idx_k [b,S,d] in dtype (dequantized for fp8): a transposed view of the stored
  [b,d,S], which XLA folds into the score matmul."""
  if view.idx_k_scale is not None:  # blocks run along d: dequantize in the [b,S,d] view
    return dequantize_fp8(jnp.swapaxes(view.idx_k, 1, 2), jnp.swapaxes(view.idx_k_scale, 1, 2), dtype)
  return jnp.swapaxes(view.idx_k, 1, 2).astype(dtype)


def gather_latents(view: LayerCache, idx: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Only the selected entries: idx [b,n] int32 -> c_kv [b,n,kv_lora], k_pe [b,n,rope] in dtype.

  Gathers the stored (fp8: quantized) rows first and dequantizes just those, so reading the
  selection costs O(n), not O(S).
  """
  take = lambda a: jnp.take_along_axis(a, idx[:, :, None], axis=1)  # [b,S,w] -> [b,n,w]
  c_kv = take(view.c_kv)
  if view.c_kv_scale is not None:
    c_kv = dequantize_fp8(c_kv, take(view.c_kv_scale), dtype)
  return c_kv.astype(dtype), take(view.k_pe).astype(dtype)


def describe(config: Config) -> str:
  """One line: the layout and bytes per token per layer (for logs and the benchmark)."""
  w = field_widths(config)
  n = bytes_per_token_per_layer(config)
  parts = f"c_kv {w['c_kv']} + k_pe {w['k_pe']}" + (f" + idx_k {w['idx_k']}" if w["idx_k"] else "")
  if config.kv_cache_dtype == "fp8":
    parts = (f"c_kv {w['c_kv']} e4m3 + {w['c_kv_scale']} fp32 scales, k_pe {w['k_pe']} bf16"
             + (f", idx_k {w['idx_k']} e4m3 + {w['idx_k_scale']} fp32 scales" if w["idx_k"] else ""))
  layers = config.num_decoder_layers
  total = n * layers * config.max_target_length
  size = next(f"{total / 2**e:.1f} {u}" for e, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if total >= 2**e)
  return (f"kv cache ({config.kv_cache_dtype}): {parts} = {n} bytes/token/layer; "
          f"{layers} layers x {config.max_target_length} tokens = {size} per row")


__all__ = ["LayerCache", "quantize_fp8", "dequantize_fp8", "init_layer_cache", "as_fields", "write", "as_stored",
           "read_latents", "read_indexer_keys", "gather_latents", "bytes_per_token_per_layer", "describe",
           "FP8_BLOCK", "field_dtypes", "field_widths"]
