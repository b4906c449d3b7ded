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

Writes go through a slot mapping (`slots`): a padding token's slot is N, dropped by the
scatter, so fixed-shape steps write only real tokens. Reads come in two kinds:
  - `sequence_view`: a sequence's whole indexer keys (every step scores all of them: O(S) per
    query, as the contiguous cache) in kv_cache's contiguous LayerCache layout;
  - `gather_selected`: only the selected latents (O(k) per query), through the page table.
So a paged step computes the same function as a contiguous one over the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config.types import Config
from MaxText.inference import kv_cache
from MaxText.inference.kv_cache import dequantize_fp8


class PagedLayerCache(NamedTuple):
  """One layer's pools ([N, n] leaves) or a scanned stack's ([L, N, n]); None leaves are absent."""
  c_kv: jax.Array                       # [(L,) N, kv_lora]
  k_pe: jax.Array                       # [(L,) N, rope]
  idx_k: jax.Array | None = None        # [(L,) N, indexer_head_dim]; None without the indexer
  c_kv_scale: jax.Array | None = None   # [(L,) N, ceil(kv_lora/128)] fp32; fp8 only
  idx_k_scale: jax.Array | None = None  # [(L,) N, ceil(indexer_head_dim/128)] fp32; fp8 only


def init_layer_pools(config: Config, num_slots: int, num_layers: int | None = None) -> PagedLayerCache:
  """Zeros [num_layers, N, n] (or [N, n]) in the dtypes of kv_cache_dtype."""
  latent, rotary = kv_cache._dtypes(config.kv_cache_dtype)
  dt = {"c_kv": latent, "k_pe": rotary, "idx_k": latent, "c_kv_scale": jnp.float32, "idx_k_scale": jnp.float32}
  layers = () if num_layers is None else (num_layers,)
  return PagedLayerCache(**{name: jnp.zeros(layers + (num_slots, w), dt[name]) if w else None
                            for name, w in kv_cache._widths(config).items()})


def init_pools(config: Config, num_pages: int, page_size: int) -> dict:
  """The whole model's pools, keyed by the Transformer's stack names as kv_cache.init_cache:
  a scanned stack gets one stacked PagedLayerCache, an unscanned one a list."""
  n = num_pages * page_size
  pools = {}
  for name, layers in (("dense_layers", config.first_num_dense_layers), ("moe_layers", config.num_moe_layers)):
    if layers:
      pools[name] = (init_layer_pools(config, n, layers) if config.scan_layers
                     else [init_layer_pools(config, n) for _ in range(layers)])
  return pools


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
  flat = slot_ids.reshape(-1)  # [B*t]

  def put(dst, upd):  # dst [(L,) N, n], upd [(L,) B, t, n]
    upd = upd.reshape(*upd.shape[:-3], flat.shape[0], upd.shape[-1]).astype(dst.dtype)  # [(L,) B*t, n]
    if dst.ndim == 3:
      return dst.at[:, flat].set(upd, mode="drop")
    return dst.at[flat].set(upd, mode="drop")

  return pools._replace(**{name: put(getattr(pools, name), v) for name, v in new.items()})


def _rows(a: jax.Array, ids: jax.Array) -> jax.Array:
  """a [N, n], ids [B, m] slot ids -> [B, m, n]."""
  return jnp.take(a, ids, axis=0, mode="clip")


def sequence_view(pools: PagedLayerCache, page_table: jax.Array, page_size: int) -> kv_cache.LayerCache:
  """A layer's pools seen through page_table [B,P] as kv_cache's contiguous LayerCache of
  S = P * page_size positions per row: c_kv/k_pe [B,S,n], idx_k [B,d,S]. Positions a row has not
  written (or pages it has not got, entries < 0) read as whatever their slot holds: callers mask
  them by position, as with a contiguous cache."""
  b, p = page_table.shape
  pos = jnp.arange(p * page_size, dtype=jnp.int32)  # [S]
  ids = jnp.maximum(page_table, 0)[:, pos // page_size] * page_size + pos % page_size  # [B,S]
  view = {name: (None if a is None else _rows(a, ids)) for name, a in pools._asdict().items()}  # [B,S,n]
  for name in ("idx_k", "idx_k_scale"):  # the contiguous cache keeps the indexer keys [B,n,S]
    if view[name] is not None:
      view[name] = jnp.swapaxes(view[name], 1, 2)
  return kv_cache.LayerCache(**view)


def gather_selected(pools: PagedLayerCache, page_table: jax.Array, idx: jax.Array, page_size: int,
                    dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Only the selected latents: idx [B,m] positions -> c_kv [B,m,kv_lora], k_pe [B,m,rope] in dtype.
  O(m) per row: each position's slot through the page table, the stored (fp8: quantized) rows
  gathered, and just those dequantized."""
  page = jnp.take_along_axis(jnp.maximum(page_table, 0), idx // page_size, axis=1)  # [B,m]
  ids = page * page_size + idx % page_size  # [B,m]
  c = _rows(pools.c_kv, ids)
  if pools.c_kv_scale is not None:
    c = dequantize_fp8(c, _rows(pools.c_kv_scale, ids), dtype)
  return c.astype(dtype), _rows(pools.k_pe, ids).astype(dtype)


def pool_bytes(config: Config, num_pages: int, page_size: int) -> int:
  """Bytes of every layer's pools for num_pages pages (scales included; with serve_speculative_tokens
  the MTP layer's pool too)."""
  layers = config.num_decoder_layers + (1 if config.serve_speculative_tokens else 0)
  return kv_cache.bytes_per_token_per_layer(config) * layers * num_pages * page_size


__all__ = ["PagedLayerCache", "init_layer_pools", "init_pools", "slots", "write", "sequence_view",
           "gather_selected", "pool_bytes"]
