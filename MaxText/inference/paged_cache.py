"""Reads of the paged pools (paged_pools.py), the routes the decode kernels take: the indexer's scores over
every cached key, dense attention over every latent, a row's whole sequence, the selected slots.

Reads come in these kinds, every one of whole pages but the last two:
  - `select_over_pages` / `PagedKeys`: the indexer scores every cached key of a row (O(S) per query,
    as over a contiguous cache) a block of pages at a time where the pages lie: each block's
    [page, d] pages gathered whole into a small buffer and scored there, so the [S, d] keys are
    never copied out (a token-by-token gather of them cost more than the scoring itself);
  - `dense_over_pages`: dense attention over every latent of a row, a block of pages at a time where
    they lie (online softmax), never the row's [S, c] latents copied out;
  - `sequence_view`: a row's whole sequence in kv_cache's contiguous LayerCache layout, gathered
    page by page (the benchmark's contiguous reference; tests);
  - `gather_selected`: only the selected latents (O(k) per query), through the page table;
  - `attend_selected`: the attention over the selected slots in a kernel that reads them where they lie
    (sparse_decode "triton"), no [B, k, c] gather to HBM.
So a paged step computes the same function as a contiguous one over the same tokens, score for
score (kernels/cached_attention.py: both key sources score with index_scores' arithmetic).

On a mesh each read runs under shard_map on a device's own page shard (paged_pools.on_shards): no device
reads another's pool.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.inference import kv_cache
from MaxText.inference.kv_cache import dequantize_fp8
from MaxText.inference.paged_pools import PagedLayerCache, on_shards, page_values, row_slots
from MaxText.kernels import backend, paged_decode, paged_decode_gpu
from MaxText.kernels.cached_attention import latent_attention_blocks
from MaxText.kernels.fp8_blocks import is_paired, take_slots
from MaxText.kernels.index_scores import row_index_scores
from MaxText.kernels.topk_indices import onehot_rows

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
  layer (every read here): pools are a stack's [L, N, n], layer `layer` read in place (paged_pools.layer_of)."""
  present = _present(pools, ("idx_k", "idx_k_scale"))

  def run(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P], rows [B_l,...]
    table = jnp.where(arrays[0] >= 0, arrays[0] - first // page_size, -1)  # [B_l,P] local pages
    return fn(PagedKeys(stores["idx_k"], stores.get("idx_k_scale"), table, page_size), *arrays[1:])

  return on_shards(run, present, ((page_table, 0),) + tuple((a, 0) for a in rows), pool_out=False,
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
          cc = dequantize_fp8(cc, page_values(stores["c_kv_scale"], pages, page_size, row_slots(stores, "c_kv_scale")),
                              q_abs.dtype)
        return cc, page_values(stores["k_pe"], pages, page_size, row_slots(stores, "k_pe"))

      return latent_attention_blocks(*(a[None] for a in rest[:2]), read_block, n, per_block * page_size,
                                     *(a[None] for a in rest[2:]), scale, precision)[0]  # [t,h,c]

    rows = (table,) + tuple(arrays[1:])
    return jax.lax.map(one_row, rows) if table.shape[0] > 1 else one_row([a[0] for a in rows])[None]  # [B_l,t,h,c]

  rows = ((page_table, 0), (q_abs, 0), (q_pe, 0), (c_new, 0), (pe_new, 0), (start, 0))
  return on_shards(run, present, rows, pool_out=False, check_vma=False, layer=layer)


def sequence_view(pools: PagedLayerCache, page_table: jax.Array, page_size: int,
                  layer: jax.Array | None = None) -> kv_cache.LayerCache:
  """A layer's pools seen through page_table [B,P] as kv_cache's contiguous LayerCache of
  S = P * page_size positions per row: c_kv/k_pe [B,S,n], idx_k [B,d,S], gathered page by page.
  Positions a row has not written (or pages it has not got, entries < 0) read as whatever their
  slot holds: callers mask them by position, as with a contiguous cache."""
  present = {name: a for name, a in pools._asdict().items() if a is not None}

  def read(stores, arrays, first):  # on a page shard: stores [N_l, n], table [B_l,P]
    pages = jnp.maximum(arrays[0], 0) - first // page_size  # [B_l,P] local pages
    return {name: page_values(a, pages, page_size, row_slots(stores, name)) for name, a in stores.items()}  # [B_l,S,n]

  got = on_shards(read, present, ((page_table, 0),), pool_out=False, layer=layer)
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
  (first: the shard's first slot, paged_pools.on_shards')."""
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
    return {name: take_slots(a, ids, row_slots(stores, name)) for name, a in stores.items()}  # [B_l,m,n] as stored

  got = on_shards(read, present, ((page_table, 0), (idx, 0)), pool_out=False, layer=layer)
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
  its own page shard (a row's pages lie in its device's shard: paged_pools' module doc), as gather_selected reads."""
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

  return on_shards(run, present, ((page_table, 0), (idx, 0), (valid, 0), (q_abs, 0), (q_pe, 0)), pool_out=False,
                    check_vma=False, layer=layer)  # a pallas_call's outputs carry no varying-axes type


__all__ = ["PagedKeys", "select_over_pages", "dense_over_pages", "sequence_view", "lookup_pages", "gather_selected",
           "attend_selected", "mla_splits"]
