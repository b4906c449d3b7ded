"""What a layer reads of its cache during inference: the one interface MLA.attend_cached uses.

A CacheView wraps one layer's storage, contiguous (kv_cache.LayerCache, [b,S,n] per row) or
paged (paged_pools.PagedLayerCache plus the step's page table), and answers the same
questions either way, so the model's math is written once for both:

    length              S, the slots a row can see (positions >= a row's length are masked)
    select_indexer(..)  the indexer's top-k over every slot's key and the new tokens' (each query
                        scores all: O(S)); paged, a block of pages at a time where they lie
    latents(dtype)      every slot's c_kv [b,S,c], k_pe [b,S,r] (a contiguous copy; tests)
    attend_dense(..)    dense attention over every valid slot (paged: a block of pages at a time)
    gather(idx, dtype)  the selected slots' c_kv [b,n,c], k_pe [b,n,r] (sparse: O(k) per query)
    attend_selected(..) a decode step's attention over its selected slots read by a kernel where they lie
                        (backend.py's sparse_decode "triton"; None where no kernel applies: gather instead)
    stored(name, x)     x as a later read will return it (rounded to the storage dtype; fp8 blocks)

A view is a pytree; for a scanned layer stack every array has a leading L axis (the page table
too, broadcast), so the stack scans layers and views together. A paged stack's view also holds
`layer` [L] (its layers' indices): the scan then takes the stacked pools whole, unsliced
(`scan_parts` / `with_store`), and each layer reads its part of them in place (paged_pools.layer_of):
sliced by the scan, every layer's pool was copied out whole each step (a v5e's 4-layer 16 x 128K fp8
step 26 ms, not ~4 x 3). `mode` ("sparse" | "dense") and `index_head_chunk` are static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.inference import kv_cache, paged_cache, paged_pools
from MaxText.kernels import backend
from MaxText.kernels.cached_attention import Absorbed, ContiguousKeys, latent_attention_dense, merge_row, select_spliced
from MaxText.kernels.paged_decode import fp8_scored_queries


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
  store: kv_cache.LayerCache | paged_pools.PagedLayerCache
  absorbed: Absorbed | None  # the layer's head-major wkv_b (None: split from the parameters)
  page_table: jax.Array | None = None  # [B,P] int32 (paged only)
  page_size: int = dataclasses.field(default=0, metadata=dict(static=True))
  mode: str = dataclasses.field(default="sparse", metadata=dict(static=True))
  index_head_chunk: int = dataclasses.field(default=16, metadata=dict(static=True))
  layer: jax.Array | None = None  # int32 [] inside a scan ([L] outside): store is the stack's [L, N, n] pools

  def scan_parts(self) -> tuple[CacheView, object]:
    """(this view without its store, the store): a scan slices the first and broadcasts the second (a paged
    stack's pools, read by layer index); a view without `layer`: (itself, None), its store sliced too."""
    if self.layer is None:
      return self, None
    return dataclasses.replace(self, store=None), self.store

  def with_store(self, store) -> CacheView:
    """scan_parts' inverse inside the scan body (store None: this view as it is)."""
    return self if store is None else dataclasses.replace(self, store=store)

  @property
  def paged(self) -> bool:
    return self.page_table is not None

  @property
  def length(self) -> int:
    if self.paged:
      return self.page_table.shape[-1] * self.page_size
    return self.store.c_kv.shape[-2]

  def _contiguous(self) -> kv_cache.LayerCache:
    """The rows' whole sequences in kv_cache's layout (paged: gathered through the page table;
    under jit the fields a caller does not read are never gathered)."""
    if self.paged:
      return paged_cache.sequence_view(self.store, self.page_table, self.page_size, self.layer)
    return self.store

  def select_indexer(self, q_i: jax.Array, w_i: jax.Array, k_new: jax.Array, positions: jax.Array, select, *,
                     max_bytes: int, precision=None, fp8_queries: bool = False) -> tuple[jax.Array, ...]:
    """kernels.cached_attention.select_spliced over this cache's indexer keys (and the new tokens'
    k_new [b,t,d] as stored): q_i [b,t,h,d], w_i [b,t,h], positions [b,t] -> select's arrays [b,t,...].
    Paged: the keys are scored where their pages lie (paged_cache.PagedKeys), on a mesh each
    device over its own rows and page shard; never gathered token by token.

    fp8_queries (config indexer_fp8_queries) with an fp8 indexer cache: the queries are rounded to e4m3
    with a scale per 128-block HERE, the one place every scoring path (contiguous, paged XLA loop, Pallas
    kernel) takes them from (paged_decode.fp8_scored_queries), so paged and contiguous stay equal."""
    if fp8_queries and self.store.idx_k_scale is not None:
      q_i, w_i = fp8_scored_queries(q_i, w_i)  # [b,t,h,d] bf16 e4m3 values, [b,t,h] w x the queries' scales
    def run(keys, q, w, new, pos):
      return select_spliced(q, w, keys, new, pos, select, head_chunk=self.index_head_chunk, max_bytes=max_bytes,
                            precision=precision)
    if self.paged:
      return paged_cache.select_over_pages(self.store, self.page_table, self.page_size, run, q_i, w_i, k_new,
                                           positions, layer=self.layer)
    return run(ContiguousKeys(kv_cache.read_indexer_keys(self.store)), q_i, w_i, k_new, positions)

  def latents(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    return kv_cache.read_latents(self._contiguous(), dtype)

  def attend_dense(self, q_abs: jax.Array, q_pe: jax.Array, c_new: jax.Array, pe_new: jax.Array,
                   positions: jax.Array, scale: float, precision=None) -> jax.Array:
    """Absorbed attention over every cached slot before each row's new tokens and the new tokens
    themselves (causal): q_abs [b,t,h,c], q_pe [b,t,h,r], c_new [b,t,c], pe_new [b,t,r] (as stored),
    positions [b,t] -> o_lat [b,t,h,c]. Contiguous: latent_attention_dense over the whole cache;
    paged: a block of pages at a time where they lie (paged_cache.dense_over_pages)."""
    start = positions[:, 0]
    if self.paged:
      return paged_cache.dense_over_pages(self.store, self.page_table, self.page_size, q_abs, q_pe, c_new, pe_new,
                                          start, scale, precision, self.layer)
    valid = jnp.arange(self.length, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # [b,t,S]
    return latent_attention_dense(q_abs, q_pe, *self.latents(q_abs.dtype), c_new, pe_new, valid, start, scale,
                                  precision)

  def gather(self, idx: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    if self.paged:
      return paged_cache.gather_selected(self.store, self.page_table, idx, self.page_size, dtype, self.layer)
    return kv_cache.gather_latents(self.store, idx, dtype)

  def attend_selected(self, q_abs: jax.Array, q_pe: jax.Array, idx: jax.Array, valid: jax.Array, c_new: jax.Array,
                      pe_new: jax.Array, start: jax.Array, scale: float) -> jax.Array | None:
    """A decode step's attention over its selected slots by a kernel that reads them where they lie, where
    backend.py's sparse_decode names one ("triton") and the cache is paged; else None (the caller gathers):
    q_abs [b,1,h,c], q_pe [b,1,h,r], idx / valid [b,1,k], the new token's c_new [b,1,c], pe_new [b,1,r] (as
    stored) at start [b] -> o_lat [b,1,h,c] fp32. The new token's latent is not in the pool until the step's
    write: its slot is left out of the kernel's and merged in after (cached_attention.merge_row)."""
    if not self.paged or backend.choice("sparse_decode") != "triton" or idx.shape[1] != 1:
      return None
    fresh = idx[:, 0] == start[:, None]  # [b,k] the new token's position (selected at most once)
    o, lse = paged_cache.attend_selected(self.store, self.page_table, idx[:, 0], valid[:, 0] & ~fresh, q_abs[:, 0],
                                         q_pe[:, 0], self.page_size, scale, self.layer)  # [b,h,c], [b,h]
    c, pe = c_new[:, 0].astype(jnp.float32), pe_new[:, 0].astype(jnp.float32)  # [b,c], [b,r]
    hi = jax.lax.Precision.HIGHEST
    logit = (jnp.einsum("bhc,bc->bh", q_abs[:, 0].astype(jnp.float32), c, precision=hi)
             + jnp.einsum("bhr,br->bh", q_pe[:, 0].astype(jnp.float32), pe, precision=hi)) * scale  # [b,h]
    return merge_row(o, lse, logit, c, jnp.any(fresh & valid[:, 0], axis=1))[:, None]  # [b,1,h,c]

  def stored(self, name: str, x: jax.Array) -> jax.Array:
    return kv_cache.as_stored(self.store, name, x)


def stack_views(stores: dict, absorbed: dict | None, *, mode: str, index_head_chunk: int,
                page_table: jax.Array | None = None, page_size: int = 0) -> dict:
  """{stack name: CacheView} for Transformer(cache=...): a scanned stack's stacked store [L,...]
  gets one view (the page table broadcast to [L,B,P]), an unscanned stack a list of views."""
  views = {}
  for name, store in stores.items():
    ab = None if absorbed is None else absorbed[name]
    if isinstance(store, list):
      views[name] = [CacheView(s, None if ab is None else ab[i], page_table, page_size, mode, index_head_chunk)
                     for i, s in enumerate(store)]
    else:
      layers = store.c_kv.shape[0]
      table = None if page_table is None else jnp.broadcast_to(page_table, (layers,) + page_table.shape)
      layer = None if page_table is None else jnp.arange(layers, dtype=jnp.int32)  # paged: read by index
      views[name] = CacheView(store, ab, table, page_size, mode, index_head_chunk, layer)
  return views


def write_stacks(stores: dict, entries: dict, write) -> dict:
  """Every stack's new entries written by write(store, **entries): a scanned stack's stacked store
  at once, an unscanned stack's per-layer stores one by one (the layout of stack_views)."""
  out = {}
  for name, store in stores.items():
    if isinstance(store, list):
      out[name] = [write(s, **e) for s, e in zip(store, entries[name])]
    else:
      out[name] = write(store, **entries[name])
  return out


__all__ = ["CacheView", "stack_views", "write_stacks"]
