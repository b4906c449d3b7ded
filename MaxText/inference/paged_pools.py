"""Paged device pools for the MLA latent and the indexer keys, under one page table: their layout, where
they shard, and the writes (paged_cache.py reads them: the kernels' routes).

A pool holds `num_pages * page_size` token slots per layer; page p holds slots
p*page_size .. p*page_size + page_size - 1. A sequence's page table row lists its pages in
order, so its position i lives in slot page_table[i // page_size] * page_size + i % page_size.
Both pools (the latent c_kv + k_pe, and the indexer key idx_k) are indexed by the same slots:
one page table, one allocator (page_allocator.py), prefix pages shared by both alike.

Per slot the pools store what kv_cache.py stores per position (kv_cache_dtype float32 /
bfloat16 / fp8 with one fp32 scale per 128-element block of c_kv and idx_k; k_pe bf16 under
fp8), flattened over the slot axis:

    c_kv   [(L,) N, kv_lora]     k_pe [(L,) N, rope]     idx_k [(L,) N, d_I]      N = pages * page

fp8 and bf16 fields are held as their bits, in same-width unsigned ints (kv_cache.storage_dtype:
uint8 / uint16), read back as values where a block is gathered (kv_cache.as_values): XLA:CPU
updates a float8 or bfloat16 array through an f16/f32 copy of all of it (float normalization), so
every write of an fp8 pool rewrote the whole pool (29 ms a step at 8K slots; 0.06 ms as uint8).
The fp8 latent (512 codes a slot) is held as 128 uint32 words a slot (kv_cache.storage_dtype,
fp8_blocks.to_words): a TPU tiles an 8-bit [N, 512] array (32, 128), its row gather and scatter want
(8, 128), and XLA copied the whole pool between the two twice a step (docs/kernels.md).
Under backend.py's rope_storage "rows" (the tpu row) the bf16 k_pe (64 values a slot) is held as int32
words, 2 values each, R slots a pool row: [N / R, R * 32] with R = 4 (ROW_WORDS = 128 lanes) at the
official sizes (slot s in row s // R, words (s % R) * 32 ..); as uint16 [N, 64] a TPU laid it out
column-major and copied it whole for every step's row gather. The fp8 latent's f32 scales (4 a slot) are held
so too under "rows", 32 slots a 128-word row (`_slots_a_row`): as [L, N, 4] a v5e relaid a deep stack's whole scale
pool inside the layer loop. Every reader takes R from the pools' shapes (`row_slots`: the slots of the unpacked
fields over this one's rows), so nothing else records it.
Under backend.py's key_order "paired" (the tpu row) an fp8 idx_k of 128 (one scale a key) with pages of
whole 256-slot groups is held as int8, not uint8: the dtype says its rows are in paired order within each
group (fp8_blocks.paired_rows: the scoring kernel makes bf16 pairs of its codes by shifts alone, with no
unpacking to 32-bit lanes) and its subnormal codes flushed to zero (fp8_blocks.flush_subnormals); writes
place each slot at its row, and `page_values` returns whole pages in slot order.

Writes go through a slot mapping (`slots`): a padding token's slot is N, dropped by the
scatter, so fixed-shape steps write only real tokens.

On a mesh (under sharding.logical_rules) the pools shard over pages, on the same mesh axes as the
step's rows ("activation_batch": data, fsdp, expert; the `page_shards` of `page_sharding`): with
D shards, device s holds slots [s*N/D, (s+1)*N/D) and rows [s*B/D, (s+1)*B/D) of every step.
Invariant (the page allocator's `shards`, the engine's row placement): every page of a row's
table lies in the shard of the device that holds the row. Reads and writes then run under
shard_map on local slots, so no device ever reads another's pool (attention is data-parallel over
sequences: the MLA latent serves all heads, so tensor-parallel attention would copy it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.config.types import Config
from MaxText.inference import kv_cache
from MaxText.kernels import backend
from MaxText.kernels.fp8_blocks import PAIR_GROUP, PAIRED_DTYPE, is_paired, natural_rows, paired_rows, take_slots
from MaxText.runtime import sharding


class PagedLayerCache(NamedTuple):
  """One layer's pools ([N, n] leaves) or a scanned stack's ([L, N, n]); None leaves are absent."""
  c_kv: jax.Array                       # [(L,) N, kv_lora] (fp8: uint32 words [(L,) N, kv_lora/4])
  k_pe: jax.Array                       # [(L,) N, rope] (rope_storage "rows": int32 words [(L,) N/R, R*rope/2])
  idx_k: jax.Array | None = None        # [(L,) N, indexer_head_dim]; None without the indexer
  c_kv_scale: jax.Array | None = None   # [(L,) N, ceil(kv_lora/128)] fp32; fp8 only ("rows": [(L,) N/R', R' * 4])
  idx_k_scale: jax.Array | None = None  # [(L,) N, ceil(indexer_head_dim/128)] fp32; fp8 only


ROW_WORDS = 128  # 32-bit words a packed pool row holds (one lane-dense TPU row)


def _rope_rows(config: Config, num_slots: int) -> int:
  """Slots a k_pe pool row holds under rope_storage "rows" with a bf16 k_pe: R = ROW_WORDS / (rope / 2), or
  the largest divisor of it that divides serve_page_size (pages, and so page shards, are whole rows: 4 for the
  official rope 64 and page 64); 1 where it does not divide the pool; 0: held as uint16 bits (the "bits" way)."""
  _, rotary = kv_cache.field_dtypes(config.kv_cache_dtype)
  words = config.qk_rope_head_dim // 2
  if (backend.choice("rope_storage") != "rows" or jnp.dtype(rotary) != jnp.bfloat16 or config.qk_rope_head_dim % 2
          or ROW_WORDS % words):
    return 0
  return _slots_a_row(config, num_slots, words)


def _slots_a_row(config: Config, num_slots: int, words: int) -> int:
  """Slots of `words` 32-bit words a packed ROW_WORDS row holds: ROW_WORDS / words, or the largest divisor of it
  that divides serve_page_size (pages, and so page shards, are whole rows); 1 where words does not divide a row
  or the rows do not divide the pool. The k_pe rows' (`_rope_rows`) and, under rope_storage "rows", the fp8
  latent's scales' (32 slots of 4 at the official sizes: as [N, 4] a v5e gathered them column-major, and a deep
  stack's [L, N, 4] was relaid out whole inside the layer loop, O(L^2) a step: decode_profile --compile-for)."""
  if ROW_WORDS % words:
    return 1
  rows = math.gcd(ROW_WORDS // words, config.serve_page_size)
  return rows if num_slots % rows == 0 else 1


def paired_keys(config: Config) -> bool:
  """Whether the idx_k pool is held in paired order (module doc): key_order "paired", an fp8 cache, keys of one
  128-block (one scale a key) and pages of whole fp8_blocks.PAIR_GROUP groups."""
  latent, _ = kv_cache.field_dtypes(config.kv_cache_dtype)
  return (backend.choice("key_order") == "paired" and jnp.dtype(latent) == kv_cache.FP8 and config.use_indexer
          and config.indexer_head_dim == kv_cache.FP8_BLOCK and config.serve_page_size % PAIR_GROUP == 0)


def init_layer_pools(config: Config, num_slots: int, num_layers: int | None = None) -> PagedLayerCache:
  """Zeros [num_layers, N, n] (or [N, n]) holding the dtypes of kv_cache_dtype (fp8 / bf16 as their bits;
  an fp8 field of 512-multiple width as uint32 words, n/4: kv_cache.storage_dtype; k_pe under rope_storage
  "rows" as int32 pairs, R slots a row: [N/R, R * rope/2], ROW_WORDS wide at the official sizes)."""
  latent, rotary = kv_cache.field_dtypes(config.kv_cache_dtype)
  dt = {"c_kv": latent, "k_pe": rotary, "idx_k": latent, "c_kv_scale": jnp.float32, "idx_k_scale": jnp.float32}
  layers = () if num_layers is None else (num_layers,)
  per_row, paired = _rope_rows(config, num_slots), paired_keys(config)

  def zeros(name, w):
    pairs = name == "k_pe" and per_row > 0
    store = PAIRED_DTYPE if name == "idx_k" and paired else kv_cache.storage_dtype(dt[name], w, pairs)
    words = kv_cache.storage_width(dt[name], w, pairs)
    rows = per_row if pairs else _slots_a_row(config, num_slots, words) if name == "c_kv_scale" and per_row else 1
    shape = (num_slots // rows, rows * words)
    return jnp.zeros(layers + shape, store)

  return PagedLayerCache(**{name: zeros(name, w) if w else None for name, w in kv_cache.field_widths(config).items()})


def row_slots(stores: dict, name: str) -> int:
  """Slots a row of stores[name] holds (module doc): the most rows any field has (the slots: c_kv, scales and
  idx_k are never packed) over this field's rows."""
  return max(a.shape[-2] for a in stores.values()) // stores[name].shape[-2]


def placed(config: Config, make, mesh=None, *, abstract: bool = False):
  """make() (pools of init_layer_pools' or init_pools' layout), made where they live: on a mesh
  sharded over pages (`pool_shardings`), each device making its own pages; abstract:
  ShapeDtypeStructs with those shardings, nothing allocated."""
  shapes = jax.eval_shape(make)
  shards = None if mesh is None else pool_shardings(config, mesh, shapes)
  if abstract:
    return shapes if shards is None else jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shards)
  return jax.jit(make, out_shardings=shards)()


def init_pools(config: Config, num_pages: int, page_size: int, mesh=None, *, abstract: bool = False) -> dict:
  """The whole model's pools, keyed by the Transformer's stack names (model_step.STACKS):
  a scanned stack gets one stacked PagedLayerCache, an unscanned one a list. On a mesh sharded
  over pages (`pool_shardings`); abstract: ShapeDtypeStructs (with those shardings), nothing allocated."""
  if mesh is not None or abstract:
    return placed(config, lambda: init_pools(config, num_pages, page_size), mesh, abstract=abstract)
  n = num_pages * page_size
  pools = {}
  for name, layers in (("dense_layers", config.first_num_dense_layers), ("moe_layers", config.num_moe_layers)):
    if layers:
      pools[name] = (init_layer_pools(config, n, layers) if config.scan_layers
                     else [init_layer_pools(config, n) for _ in range(layers)])
  return pools


def _batch_axes(rules: dict, mesh) -> tuple[str, ...]:
  return tuple(a for a in rules.get("activation_batch", ()) if mesh.shape[a] > 1)


def page_axes(config: Config, mesh) -> tuple[str, ...]:
  """The mesh axes the pools' pages (and the step's rows) shard over: activation_batch's, size > 1."""
  return _batch_axes(sharding.rules_of(config), mesh)


def page_shards(config: Config, mesh) -> int:
  """How many page shards (1 without a mesh): rows and num_pages must be multiples of it."""
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in page_axes(config, mesh))


def _spec(ndim: int, dim: int, axes: tuple) -> P:
  """A PartitionSpec sharding dimension `dim` (negative: from the end) over axes."""
  spec = [None] * ndim
  spec[dim] = axes if len(axes) > 1 else axes[0]
  return P(*spec)


def pool_shardings(config: Config, mesh, pools):
  """NamedShardings of a pools pytree (init_pools' layout): the slot axis (-2) over page_axes."""
  axes = page_axes(config, mesh)
  return jax.tree.map(lambda a: NamedSharding(mesh, _spec(a.ndim, -2, axes) if axes else P()), pools)


def _local():
  """(mesh, axes) when a mesh with page shards is active (sharding.logical_rules), else None."""
  active = sharding.active_mesh()
  if active is None:
    return None
  mesh, rules = active
  axes = _batch_axes(rules, mesh)
  return (mesh, axes) if axes else None


def _shard_index(mesh, axes) -> jax.Array:
  """This device's page shard inside shard_map: axes in order, the first major (as a sharded dim)."""
  i = jnp.int32(0)
  for a in axes:
    i = i * mesh.shape[a] + jax.lax.axis_index(a)
  return i


def on_shards(fn, pools, rows, pool_out: bool, check_vma: bool = True, layer: jax.Array | None = None):
  """fn(pools, rows, first_slot) on each device's own page shard: pools leaves [.., N, n] (slot axis
  -2), rows a tuple of arrays with the row axis given as (array, dim) pairs; without page shards
  fn(pools, rows, 0). The result shards like pools (pool_out) or over rows (dim 0). check_vma=False
  for an fn whose loops start from constants (the selection kernels' fori_loops): every value in
  it is per device anyway. layer (a scalar; reads only): pools are a stack's [L, N, n] and fn reads
  layer `layer` of them in place (`layer_of`)."""
  arrays = tuple(a for a, _ in rows)
  local = _local()
  if local is None:
    if layer is not None:
      flat, first = layer_of(pools, 0, layer)
      return fn(flat, arrays, first)
    return fn(pools, arrays, 0)
  mesh, axes = local
  pool_specs = jax.tree.map(lambda a: _spec(a.ndim, -2, axes), pools)
  row_specs = tuple(_spec(a.ndim, d, axes) for a, d in rows)

  def body(pools, arrays, *layer):  # layer: () or (the layer, replicated)
    n_local = max(a.shape[-2] for a in jax.tree.leaves(pools))  # slots (a packed k_pe has fewer rows)
    first = _shard_index(mesh, axes) * n_local
    if layer:
      pools, first = layer_of(pools, first, layer[0])
    return fn(pools, arrays, first)

  out_specs = pool_specs if pool_out else P(axes)
  extra = () if layer is None else (layer,)
  return jax.shard_map(body, mesh=mesh, in_specs=(pool_specs, row_specs) + (P(),) * len(extra), out_specs=out_specs,
                       check_vma=check_vma)(pools, arrays, *extra)


def layer_of(pools, first, layer: jax.Array):
  """A stack's pools [L, N_l, n] (one page shard's: slots first ..) and a layer -> (the pools viewed flat,
  [L * N_l, n], and the first slot that makes a local slot id land in that layer's part: first - layer * N_l),
  so fn reads the layer where it lies. A scanned stack's step reads its pools so (CacheView.layer): sliced
  by the scan, each layer's pool was copied out whole every step (1 GB a layer at 16 x 128K fp8 on a v5e)."""
  n_local = max(a.shape[-2] for a in jax.tree.leaves(pools))
  flat = jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), pools)  # [L*N_l/R, R*n]: leading dims merged, no copy
  return flat, first - layer * n_local


def slots(page_table: jax.Array, positions: jax.Array, page_size: int, num_slots: int) -> jax.Array:
  """page_table [B,P] int32, positions [B,t] int32 (< 0: padding) -> slot ids [B,t] int32; a
  padding token, or a position past the table, maps to num_slots (writes there are dropped)."""
  p = positions // page_size  # [B,t]
  ok = (positions >= 0) & (p < page_table.shape[1])
  page = jnp.take_along_axis(page_table, jnp.clip(p, 0, page_table.shape[1] - 1), axis=1)  # [B,t]
  return jnp.where(ok & (page >= 0), page * page_size + positions % page_size, num_slots).astype(jnp.int32)


def write(pools: PagedLayerCache, slot_ids: jax.Array, *, c_kv: jax.Array | None = None,
          k_pe: jax.Array | None = None, idx_k: jax.Array | None = None) -> PagedLayerCache:
  """Stores new tokens' vectors [(L,) B, t, n] at slot_ids [B,t] (num_slots = dropped); fp8 fields
  are quantized here. A layer ([N,n]) or a stack ([L,N,n]: every layer at once)."""
  new = kv_cache.as_fields(pools, c_kv=c_kv, k_pe=k_pe, idx_k=idx_k)
  names = list(new)

  def put_all(dsts, arrays, first):  # on a page shard: dsts [(L,) N_l, n], slot_ids [B_l,t], upd [(L,) B_l, t, n]
    ids, upds = arrays[0], arrays[1:]
    n_local = max(d.shape[-2] for d in dsts)  # slots (a packed k_pe has fewer rows; it is written with c_kv)
    flat = ids.reshape(-1) - first  # [B_l*t] local slots
    ok = (flat >= 0) & (flat < n_local)  # padding (and any other shard's): dropped
    layers = dsts[0].shape[0] if dsts[0].ndim == 3 else 1
    # a stack as one flat [L*N_l, n] pool, layer l's slots at l*N_l ..: one 2-D scatter (a 3-D one over [L, N, n]
    # was laid out layer-minor on a v5e, every pool copied whole into that layout and back each step)
    flat = jnp.where(ok[None], jnp.arange(layers, dtype=jnp.int32)[:, None] * n_local + flat[None],
                     layers * n_local).reshape(-1)  # [L*B_l*t]
    out = []
    for dst, upd in zip(dsts, upds):
      upd = kv_cache.to_storage(upd.reshape(flat.shape[0], upd.shape[-1]), dst.dtype)  # [L*B_l*t, w]
      pool = dst.reshape(-1, dst.shape[-1])  # [L*N_l/R, R*w]
      per_row = n_local // dst.shape[-2]
      if per_row == 1:
        at = (paired_rows(flat) if is_paired(dst) else flat,)  # a paired idx_k (module doc)
      else:  # slot s: row s // R, words (s % R) * w .. + w; dropped: row L*N_l / R, past the pool
        w = upd.shape[-1]
        at = ((flat // per_row)[:, None], (flat % per_row)[:, None] * w + jnp.arange(w, dtype=jnp.int32))
      out.append(pool.at[at].set(upd, mode="drop").reshape(dst.shape))
    return tuple(out)

  dsts = tuple(getattr(pools, name) for name in names)
  rows = ((slot_ids, 0),) + tuple((new[name], -3) for name in names)
  return pools._replace(**dict(zip(names, on_shards(put_all, dsts, rows, pool_out=True))))


def _rows(a: jax.Array, ids: jax.Array, per_row: int = 1) -> jax.Array:
  """a [N / per_row, per_row * n], ids [B, m] slot ids -> [B, m, n'] values (fp8_blocks.take_slots)."""
  return kv_cache.as_values(take_slots(a, ids, per_row))


def page_values(a: jax.Array, pages: jax.Array, page_size: int, per_row: int = 1) -> jax.Array:
  """a [N / per_row, per_row * n] (slots, per_row a row), pages [B, G] page ids -> [B, G * page_size, n']
  values: whole pages, one gather slice of [page_size / per_row, per_row * n] each (never one per token)."""
  if page_size % per_row:  # pools made for another serve_page_size (tests): slot by slot
    ids = pages[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [B, G, page]
    return _rows(a, ids.reshape(pages.shape[0], -1), per_row)  # [B, G*page, n]
  rows = page_size // per_row  # pool rows a page
  by_page = a.reshape(a.shape[0] // rows, rows, a.shape[-1])  # [N/page, page/R, R*n]
  got = jnp.take(by_page, pages, axis=0, mode="clip")  # [B, G, page/R, R*n]
  if is_paired(a):  # a paired idx_k (module doc): each page's groups back in slot order
    got = natural_rows(got)  # [B, G, page, d]
  return kv_cache.as_values(got.reshape(pages.shape[0], -1, a.shape[-1] // per_row))  # [B,G*page,n] words -> values


def pool_bytes(config: Config, num_pages: int, page_size: int) -> int:
  """Bytes of every layer's pools for num_pages pages (scales included; with serve_speculative_tokens
  the MTP layer's pool too)."""
  layers = config.num_decoder_layers + (1 if config.serve_speculative_tokens else 0)
  return kv_cache.bytes_per_token_per_layer(config) * layers * num_pages * page_size


__all__ = ["PagedLayerCache", "ROW_WORDS", "init_layer_pools", "init_pools", "placed", "page_axes", "page_shards",
           "pool_shardings", "on_shards", "layer_of", "row_slots", "paired_keys", "slots", "write", "page_values",
           "pool_bytes"]
