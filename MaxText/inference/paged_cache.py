"""Paged device pools for the MLA latent and the indexer keys, under one page table.

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
pool inside the layer loop. Every reader takes R from the pools' shapes (`_per_row`: the slots of the unpacked
fields over this one's rows), so nothing else records it.
Under backend.py's key_order "paired" (the tpu row) an fp8 idx_k of 128 (one scale a key) with pages of
whole 256-slot groups is held as int8, not uint8: the dtype says its rows are in paired order within each
group (fp8_blocks.paired_rows: the scoring kernel makes bf16 pairs of its codes by shifts alone, with no
unpacking to 32-bit lanes) and its subnormal codes flushed to zero (fp8_blocks.flush_subnormals); writes
place each slot at its row, and `page_values` returns whole pages in slot order.

Writes go through a slot mapping (`slots`): a padding token's slot is N, dropped by the
scatter, so fixed-shape steps write only real tokens. Reads come in three kinds, every one of
whole pages but the last:
  - `select_over_pages` / `PagedKeys`: the indexer scores every cached key of a row (O(S) per query,
    as over a contiguous cache) a block of pages at a time where the pages lie: each block's
    [page, d] pages gathered whole into a small buffer and scored there, so the [S, d] keys are
    never copied out (a token-by-token gather of them cost more than the scoring itself);
  - `dense_over_pages`: dense attention over every latent of a row, a block of pages at a time where
    they lie (online softmax), never the row's [S, c] latents copied out;
  - `sequence_view`: a row's whole sequence in kv_cache's contiguous LayerCache layout, gathered
    page by page (the benchmark's contiguous reference; tests);
  - `gather_selected`: only the selected latents (O(k) per query), through the page table.
So a paged step computes the same function as a contiguous one over the same tokens, score for
score (kernels/cached_attention.py: both key sources score with index_scores' arithmetic).

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
from MaxText.inference.kv_cache import dequantize_fp8
from MaxText.kernels import backend, paged_decode, paged_decode_gpu
from MaxText.kernels.cached_attention import latent_attention_blocks
from MaxText.kernels.fp8_blocks import PAIR_GROUP, PAIRED_DTYPE, is_paired, natural_rows, paired_rows, take_slots
from MaxText.kernels.index_scores import row_index_scores
from MaxText.kernels.topk_indices import onehot_rows
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
  stack's [L, N, 4] was relaid out whole inside the layer loop, O(L^2) a step; tpu_compile.py at 8 layers)."""
  if ROW_WORDS % words:
    return 1
  rows = math.gcd(ROW_WORDS // words, config.serve_page_size)
  return rows if num_slots % rows == 0 else 1


def _paired_keys(config: Config) -> bool:
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
  per_row, paired = _rope_rows(config, num_slots), _paired_keys(config)

  def zeros(name, w):
    pairs = name == "k_pe" and per_row > 0
    store = PAIRED_DTYPE if name == "idx_k" and paired else kv_cache.storage_dtype(dt[name], w, pairs)
    words = kv_cache.storage_width(dt[name], w, pairs)
    rows = per_row if pairs else _slots_a_row(config, num_slots, words) if name == "c_kv_scale" and per_row else 1
    shape = (num_slots // rows, rows * words)
    return jnp.zeros(layers + shape, store)

  return PagedLayerCache(**{name: zeros(name, w) if w else None for name, w in kv_cache.field_widths(config).items()})


def _per_row(stores: dict, name: str) -> int:
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


def _on_shards(fn, pools, rows, pool_out: bool, check_vma: bool = True, layer: jax.Array | None = None):
  """fn(pools, rows, first_slot) on each device's own page shard: pools leaves [.., N, n] (slot axis
  -2), rows a tuple of arrays with the row axis given as (array, dim) pairs; without page shards
  fn(pools, rows, 0). The result shards like pools (pool_out) or over rows (dim 0). check_vma=False
  for an fn whose loops start from constants (the selection kernels' fori_loops): every value in
  it is per device anyway. layer (a scalar; reads only): pools are a stack's [L, N, n] and fn reads
  layer `layer` of them in place (`_layer_of`)."""
  arrays = tuple(a for a, _ in rows)
  local = _local()
  if local is None:
    if layer is not None:
      flat, first = _layer_of(pools, 0, layer)
      return fn(flat, arrays, first)
    return fn(pools, arrays, 0)
  mesh, axes = local
  pool_specs = jax.tree.map(lambda a: _spec(a.ndim, -2, axes), pools)
  row_specs = tuple(_spec(a.ndim, d, axes) for a, d in rows)

  def body(pools, arrays, *layer):  # layer: () or (the layer, replicated)
    n_local = max(a.shape[-2] for a in jax.tree.leaves(pools))  # slots (a packed k_pe has fewer rows)
    first = _shard_index(mesh, axes) * n_local
    if layer:
      pools, first = _layer_of(pools, first, layer[0])
    return fn(pools, arrays, first)

  out_specs = pool_specs if pool_out else P(axes)
  extra = () if layer is None else (layer,)
  return jax.shard_map(body, mesh=mesh, in_specs=(pool_specs, row_specs) + (P(),) * len(extra), out_specs=out_specs,
                       check_vma=check_vma)(pools, arrays, *extra)


def _layer_of(pools, first, layer: jax.Array):
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
  return pools._replace(**dict(zip(names, _on_shards(put_all, dsts, rows, pool_out=True))))


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


KEY_BLOCK_BYTES = 1 << 20  # fp32 bytes (one row) of one block of pages PagedKeys / dense_over_pages reads: L2-sized
SCORE_BLOCK_SLOTS = 2048  # keys a grid step of the Pallas scoring kernel reads, whole pages (at least one): on a v5e,
# 4 rows x 128K fp8 keys at 64 a page, fp32 queries: 1.56 / 1.45 / 1.33 / 1.28 ms at 512 / 1024 / 2048 / 4096 (docs/kernels.md)
PAIRED_SCORE_BLOCK_SLOTS = 8192  # the same over a paired pool (its kernel's VPU work ~2.4x less a key, so a grid step's
# fixed cost weighs more): the v5e's 16-row 128K fp8 step 3.825 / 3.746 / 3.594 ms at 2048 / 4096 / 8192 (docs/kernels.md)
GPU_SCORE_BLOCK_SLOTS = 128  # keys a program of the Triton scoring kernel reads (a power of 2 of whole pages, at least
# one): [64 heads, 128] x [128 keys, 128] a dot. Not measured on a GPU yet (benchmarks/gpu_decode_check.sh sweeps it)


class PagedKeys(NamedTuple):
  """A key source (kernels/cached_attention.py) over the indexer-key pool: each row's keys lie in
  the pages of its table row. `scores` reads them a block of pages at a time, one row at a time (a
  fori_loop over (row, block) pairs, KEY_BLOCK_BYTES of fp32 keys a block; a block past every query
  position of its row is not read, its scores -inf: the table is as wide as the batch's longest row): the block's pages
  gathered whole, scored by index_scores.row_index_scores (2-D dots: XLA:CPU's batched dot ran the
  blocks 1.8x slower) into the row's slice of the [b,tq,S] result. fp8 keys with one scale a key
  (d <= 128, the model's) are scored as their codes' values, each key's score then times its scale
  (sum_h w relu(q.(s c)) = s sum_h w relu(q.c) for s > 0: DeepGEMM's order and paged_decode's kernel's;
  no [width, d] multiply a block: no slower, 0-9% less CPU, docs/kernels.md); wider fp8 keys
  are dequantized first. Each score is index_scores' sum on the same key values: equal to
  ContiguousKeys' to f32 rounding (bit for bit over f32 keys where the dot's accumulation order agrees)."""
  idx_k: jax.Array                # [N, d] as the pool holds it (fp8: uint8 bits, int8 in paired order; a page shard's)
  idx_k_scale: jax.Array | None   # [N, ceil(d/128)] fp32; fp8 only
  table: jax.Array                # [b, P] page ids into idx_k's pages (< 0: none; read as page 0, masked)
  page_size: int

  @property
  def slots(self) -> int:
    return self.table.shape[1] * self.page_size

  def row(self, i: jax.Array) -> "PagedKeys":
    return self._replace(table=jax.lax.dynamic_slice_in_dim(self.table, i, 1, axis=0))  # [1,P]

  def scores(self, q: jax.Array, w: jax.Array, pos: jax.Array, *, head_chunk: int, precision=None) -> jax.Array:
    """q [b,tq,h,d], w [b,tq,h], pos [b,tq] -> [b,tq,S] fp32, -inf at slots past pos. One query a row
    (a decode step) goes through the Pallas kernel where backend.py's table says so (paged_scoring)."""
    if q.shape[1] == 1 and backend.choice("paged_scoring") != "xla":
      return self._kernel_scores(q, w, pos)
    (b, p), d, page = self.table.shape, self.idx_k.shape[-1], self.page_size
    per_block = max(1, min(p, KEY_BLOCK_BYTES // (page * d * 4)))  # pages a block
    n = -(-p // per_block)
    width = per_block * page  # slots a block
    table = jnp.pad(jnp.maximum(self.table, 0), ((0, 0), (0, n * per_block - p)))  # [b, n*per_block]

    def score(r, j):  # row r's block j -> [tq,width]
      pages = jax.lax.dynamic_slice(table, (r, j * per_block), (1, per_block))  # [1,per_block]
      keys, key_scale = self.block_keys(pages)  # [width,d], [width] or None
      got = row_index_scores(q[r], w[r], keys, head_chunk=head_chunk, precision=precision)  # [tq,width]
      if key_scale is not None:
        got = got * key_scale[None]  # [tq,width]
      slot = j * width + jnp.arange(width, dtype=jnp.int32)  # [width]
      return jnp.where(slot[None, :] <= pos[r][:, None], got, -jnp.inf)  # [tq,width]

    def block(i, out):  # (row r, block j) = divmod(i, n); out [b,tq,n*width]
      r, j = i // n, i % n
      got = jax.lax.cond(j * width <= jnp.max(pos[r]), score, lambda r, j: jnp.full((q.shape[1], width), -jnp.inf),
                         r, j)  # a block past every query of the row: not read
      return jax.lax.dynamic_update_slice(out, got[None], (r, 0, j * width))

    out = jnp.full((b, q.shape[1], n * width), -jnp.inf, jnp.float32)
    out = jax.lax.fori_loop(0, b * n, block, out) if b * n > 1 else block(0, out)
    return out[..., :self.slots]  # [b,tq,S]

  def block_keys(self, pages: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """pages [1,m] -> (keys [m*page, d], scales [m*page] or None) for scores' block: fp8 keys with one
    scale a key as their codes' values (bf16, exact) and the scales their scores take (sum_h w relu(q.(s c)) =
    s sum_h w relu(q.c), s > 0); wider fp8 keys dequantized (scales None), others as they are."""
    keys = page_values(self.idx_k, pages, self.page_size)[0]  # [width,d] values (fp8: still quantized)
    if self.idx_k_scale is None:
      return keys, None
    scale = page_values(self.idx_k_scale, pages, self.page_size)[0]  # [width, ceil(d/128)]
    if scale.shape[-1] == 1:  # the codes as bf16 (exact): row_index_scores' bf16 dot with fp8 (bf16) queries
      return kv_cache.as_values(keys).astype(jnp.bfloat16), scale[:, 0]
    return dequantize_fp8(keys, scale), None

  def _kernel_scores(self, q: jax.Array, w: jax.Array, pos: jax.Array) -> jax.Array:
    """scores' function for tq = 1 by a Pallas kernel (backend.py's paged_scoring: "pallas", paged_decode's Mosaic
    kernel, interpreted off a TPU; "triton", paged_decode_gpu's, interpreted off a GPU): the table padded with pages
    past S (read as page 0, masked by pos) to whole blocks of pages."""
    p, d = self.table.shape[1], q.shape[-1]
    triton = backend.choice("paged_scoring") == "triton"
    if triton:  # a power of 2 of pages (Triton's blocks): the largest within GPU_SCORE_BLOCK_SLOTS, at least one
      per_block = 1 << max(0, (GPU_SCORE_BLOCK_SLOTS // self.page_size).bit_length() - 1)
    else:
      block = PAIRED_SCORE_BLOCK_SLOTS if is_paired(self.idx_k) else SCORE_BLOCK_SLOTS
      per_block = max(1, min(block // self.page_size, p))  # pages a grid step
    table = jnp.pad(self.table, ((0, 0), (0, -p % per_block)), constant_values=-1)  # [b, P'] whole blocks
    kernel = paged_decode_gpu.paged_index_scores if triton else paged_decode.paged_index_scores
    got = kernel(q[:, 0], None, paged_decode.index_weights(w[:, 0], d), self.idx_k, self.idx_k_scale, table,
                 pos[:, 0], self.page_size, pages_per_block=per_block)
    return got[:, None, :self.slots]  # [b,1,S]


LATENT_FIELDS = ("c_kv", "c_kv_scale", "k_pe")  # what attention reads of a pool (the indexer's: idx_k, idx_k_scale)


def _present(pools: PagedLayerCache, names: tuple[str, ...]) -> dict:
  """{name: pool} for the named fields a pool holds (a None field is absent: no scales without fp8)."""
  return {name: getattr(pools, name) for name in names if getattr(pools, name) is not None}


def select_over_pages(pools: PagedLayerCache, page_table: jax.Array, page_size: int, fn, *rows: jax.Array,
                      layer: jax.Array | None = None):
  """fn(keys, *rows) with keys the rows' PagedKeys (page_table [B,P]) and rows arrays [B,...]: on a
  mesh each device runs fn on its own rows over its own page shard (shard_map; no pool moves), its
  outputs [B,...] sharded over rows. The indexer's selection (cache_view.CacheView.select_indexer).
  layer (every read here): pools are a stack's [L, N, n], layer `layer` read in place (_layer_of)."""
  present = _present(pools, ("idx_k", "idx_k_scale"))

  def run(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P], rows [B_l,...]
    table = jnp.where(arrays[0] >= 0, arrays[0] - first // page_size, -1)  # [B_l,P] local pages
    return fn(PagedKeys(stores["idx_k"], stores.get("idx_k_scale"), table, page_size), *arrays[1:])

  return _on_shards(run, present, ((page_table, 0),) + tuple((a, 0) for a in rows), pool_out=False,
                    check_vma=False, layer=layer)


def dense_over_pages(pools: PagedLayerCache, page_table: jax.Array, page_size: int, q_abs: jax.Array,
                     q_pe: jax.Array, c_new: jax.Array, pe_new: jax.Array, start: jax.Array, scale: float,
                     precision=None, layer: jax.Array | None = None) -> jax.Array:
  """Dense attention over every latent a row has cached, read where its pages lie: q_abs [B,t,h,c],
  q_pe [B,t,h,r], the new tokens' c_new [B,t,c], pe_new [B,t,r] (as stored) at slots start[B]..,
  page_table [B,P] -> o_lat [B,t,h,c] (cached_attention.latent_attention_blocks: a block of whole
  pages at a time, online softmax; no [S, c] copy of a row's latents), one row after another (a
  lax.map: a block over all rows would shrink to one page at 4 rows, 1.27x the contiguous step at
  128K). A block's latents (fp32) and its [h,t,width] logits each stay within KEY_BLOCK_BYTES (at
  least one page). On a mesh each device attends its own rows over its own page shard, as
  select_over_pages."""
  present = _present(pools, LATENT_FIELDS)
  b, t, h, c = q_abs.shape

  def run(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P], rows [B_l,...]
    table = jnp.maximum(arrays[0], 0) - first // page_size  # [B_l,P] local pages (none: page 0, masked by start)
    p = table.shape[1]
    slot_bytes = 4 * max(c + pe_new.shape[-1], h * t)  # one slot's latents or logits, one row
    per_block = max(1, min(p, KEY_BLOCK_BYTES // (page_size * slot_bytes)))  # pages a block
    n = -(-p // per_block)
    table = jnp.pad(table, ((0, 0), (0, n * per_block - p)))  # [B_l, n*per_block]: past P reads page 0, masked

    def one_row(row):  # table [n*per_block], q_abs [t,h,c], q_pe [t,h,r], c_new [t,c], pe_new [t,r], start []
      row_table, *rest = row

      def read_block(i):  # -> c [1,width,c], pe [1,width,r]
        pages = jax.lax.dynamic_slice_in_dim(row_table, i * per_block, per_block)[None]  # [1,per_block]
        cc = page_values(stores["c_kv"], pages, page_size)  # [1,width,c] values (fp8: still quantized)
        if "c_kv_scale" in stores:
          cc = dequantize_fp8(cc, page_values(stores["c_kv_scale"], pages, page_size, _per_row(stores, "c_kv_scale")),
                              q_abs.dtype)
        return cc, page_values(stores["k_pe"], pages, page_size, _per_row(stores, "k_pe"))

      return latent_attention_blocks(*(a[None] for a in rest[:2]), read_block, n, per_block * page_size,
                                     *(a[None] for a in rest[2:]), scale, precision)[0]  # [t,h,c]

    rows = (table,) + tuple(arrays[1:])
    return jax.lax.map(one_row, rows) if table.shape[0] > 1 else one_row([a[0] for a in rows])[None]  # [B_l,t,h,c]

  rows = ((page_table, 0), (q_abs, 0), (q_pe, 0), (c_new, 0), (pe_new, 0), (start, 0))
  return _on_shards(run, present, rows, pool_out=False, check_vma=False, layer=layer)


def sequence_view(pools: PagedLayerCache, page_table: jax.Array, page_size: int,
                  layer: jax.Array | None = None) -> kv_cache.LayerCache:
  """A layer's pools seen through page_table [B,P] as kv_cache's contiguous LayerCache of
  S = P * page_size positions per row: c_kv/k_pe [B,S,n], idx_k [B,d,S], gathered page by page.
  Positions a row has not written (or pages it has not got, entries < 0) read as whatever their
  slot holds: callers mask them by position, as with a contiguous cache."""
  present = {name: a for name, a in pools._asdict().items() if a is not None}

  def read(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P]
    pages = jnp.maximum(arrays[0], 0) - first // page_size  # [B_l,P] local pages
    return {name: page_values(a, pages, page_size, _per_row(stores, name)) for name, a in stores.items()}  # [B_l,S,n]

  got = _on_shards(read, present, ((page_table, 0),), pool_out=False, layer=layer)
  view = {name: got.get(name) for name in pools._fields}  # [B,S,n]
  for name in ("idx_k", "idx_k_scale"):  # the contiguous cache keeps the indexer keys [B,n,S]
    if view[name] is not None:
      view[name] = jnp.swapaxes(view[name], 1, 2)
  return kv_cache.LayerCache(**view)


ONEHOT_MAX_PAGES = 4096  # page_lookup "onehot" up to this many pages a row (its work grows as m x P, a gather's as m)


def lookup_pages(table: jax.Array, pages: jax.Array) -> jax.Array:
  """table [B,P] page ids (< 0: none, read as page 0), pages [B,m] indices into each row's table (< P) ->
  table[b, pages[b, i]] [B,m]. backend.py's page_lookup: "gather", a take_along_axis; "onehot" (P <=
  ONEHOT_MAX_PAGES), a one-hot [B,m,P] dot with the ids' four bytes as bf16 [B,P,4] (each exact, one product
  a sum in the f32 accumulator: exact for any int32 id) on the MXU: on a TPU a gather costs ~10 ns an index."""
  t = jnp.maximum(table, 0)  # [B,P]
  if backend.choice("page_lookup") != "onehot" or t.shape[1] > ONEHOT_MAX_PAGES:
    return jnp.take_along_axis(t, pages, axis=1)
  return onehot_rows(t[..., None], pages)[..., 0]  # [B,m]


def _local_slots(table: jax.Array, idx: jax.Array, page_size: int, first) -> jax.Array:
  """Selected positions idx [B,m] through a page shard's table [B,P] -> their slots in the shard's pools [B,m]
  (first: the shard's first slot, _on_shards')."""
  return lookup_pages(table, idx // page_size) * page_size + idx % page_size - first


def gather_selected(pools: PagedLayerCache, page_table: jax.Array, idx: jax.Array, page_size: int,
                    dtype=jnp.float32, layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Only the selected latents: idx [B,m] positions -> c_kv [B,m,kv_lora], k_pe [B,m,rope] in dtype.
  O(m) per row: each position's slot through the page table, the stored (fp8: quantized) rows
  gathered, and just those dequantized."""
  present = _present(pools, LATENT_FIELDS)

  def read(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P], idx [B_l,m]
    table, idx = arrays
    ids = _local_slots(table, idx, page_size, first)  # [B_l,m]
    return {name: take_slots(a, ids, _per_row(stores, name)) for name, a in stores.items()}  # [B_l,m,n] as stored

  got = _on_shards(read, present, ((page_table, 0), (idx, 0)), pool_out=False, layer=layer)
  if "c_kv_scale" in got:  # fp8: decoded from the stored words a block at a time (dequantize_fp8)
    c = dequantize_fp8(got["c_kv"], got["c_kv_scale"], dtype)
  else:
    c = kv_cache.as_values(got["c_kv"])
  return c.astype(dtype), kv_cache.as_values(got["k_pe"]).astype(dtype)


# The Triton MLA kernel as the engine calls it (attend_selected; none of these measured on a GPU yet):
SELECTED_BLOCK = 32  # slots a step of its loop (paged_decode_gpu.sparse_mla_decode's block)
HEADS_A_PROGRAM = 32  # heads a program
GPU_PROGRAMS = 128  # programs its grid should reach (an H200 has 132 SMs): rows x head blocks alone are 64 at
# 16 rows of 128 heads, so the selected slots split (split-KV, mla_splits)


def mla_splits(rows: int, heads: int, slots: int) -> int:
  """Splits of a row's `slots` selected slots for the Triton MLA kernel: the largest power of 2 that brings its
  rows x head blocks x splits programs to GPU_PROGRAMS at most, with whole SELECTED_BLOCKs a split (1 where the
  rows and heads alone reach it)."""
  programs = rows * max(1, heads // HEADS_A_PROGRAM)
  splits = 1
  while programs * splits * 2 <= GPU_PROGRAMS and slots % (SELECTED_BLOCK * splits * 2) == 0:
    splits *= 2
  return splits


def attend_selected(pools: PagedLayerCache, page_table: jax.Array, idx: jax.Array, valid: jax.Array,
                    q_abs: jax.Array, q_pe: jax.Array, page_size: int, scale: float,
                    layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Decode attention over only the selected latents, read by the kernel where they lie (backend.py's
  sparse_decode "triton": paged_decode_gpu.sparse_mla_decode; no [B,k,c] gather to HBM first): idx [B,k]
  positions with valid [B,k], q_abs [B,H,c], q_pe [B,H,r] -> (o_lat [B,H,c] fp32, lse [B,H]: the log of the
  softmax's denominator, -inf for a row with nothing valid). On a mesh each device attends its own rows over
  its own page shard (a row's pages lie in its device's shard: module doc), as gather_selected reads."""
  present = _present(pools, LATENT_FIELDS)
  k = idx.shape[1]
  pad = -k % SELECTED_BLOCK  # the kernel's loop takes whole blocks: padding slots invalid
  idx, valid = jnp.pad(idx, ((0, 0), (0, pad))), jnp.pad(valid, ((0, 0), (0, pad)))  # [B, k']

  def run(stores, arrays, first):  # on a page shard: stores [N_l, n], rows [B_l, ...]
    table, idx, valid, q_abs, q_pe = arrays
    ids = _local_slots(table, idx, page_size, first)  # [B_l,k']
    (rows, heads, _), slots = q_abs.shape, ids.shape[1]
    return paged_decode_gpu.sparse_mla_decode(q_abs, q_pe, ids, valid, stores["c_kv"], stores["k_pe"],
                                              stores.get("c_kv_scale"), scale, block=SELECTED_BLOCK,
                                              heads_per_program=HEADS_A_PROGRAM, splits=mla_splits(rows, heads, slots),
                                              return_lse=True)

  return _on_shards(run, present, ((page_table, 0), (idx, 0), (valid, 0), (q_abs, 0), (q_pe, 0)), pool_out=False,
                    check_vma=False, layer=layer)  # a pallas_call's outputs carry no varying-axes type


def pool_bytes(config: Config, num_pages: int, page_size: int) -> int:
  """Bytes of every layer's pools for num_pages pages (scales included; with serve_speculative_tokens
  the MTP layer's pool too)."""
  layers = config.num_decoder_layers + (1 if config.serve_speculative_tokens else 0)
  return kv_cache.bytes_per_token_per_layer(config) * layers * num_pages * page_size


__all__ = ["PagedLayerCache", "init_layer_pools", "init_pools", "placed", "page_axes", "page_shards", "pool_shardings", "slots",
           "write", "PagedKeys", "select_over_pages", "dense_over_pages", "sequence_view", "gather_selected", "attend_selected",
           "pool_bytes",
           "page_values"]
