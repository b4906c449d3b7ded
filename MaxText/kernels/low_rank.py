"""Low-rank updates kept apart from the weight they update (LoRA's adapters, layers/lora.py and lora_rows.py).

A linear y = x W with n low-rank updates (A_k [in, r], B_k [r, out], each B holding its alpha / r) computes

    y = x W + sum_k m[b,k] (x A_k) B_k          m [b,n]: which rows take update k (None: every row, every k)

Invariant: the update is never added into W. The base product and the update are each accumulated in fp32 and
summed in fp32, and only that sum is rounded to the compute dtype, once. Why: a bf16 (or any low-precision) W,
or a product x W already rounded to bf16, sits on the bf16 grid, and an update smaller than half its spacing
(2^-9 relative) then rounds away entirely, not at random: with an fp8 wkv_b and bf16 compute, an adapter
changing the weight by 0.07% kept 44% of its effect when added to x W in bf16 and 15% when merged into a bf16
W; summed in fp32 it keeps all of it (tests/unit/test_lora_exact.py).

MLA's absorbed form never forms x W for wkv_b [c, h*(nope+v)] (kernels/sparse_attention.absorb_q /
unabsorb_out contract q_nope with its key part and o_lat with its value part); `absorbed_q_delta` and
`absorbed_out_delta` are the same update contracted in that order, so W + sum_k A_k B_k holds in every path:
the training mask path (the Linear's forward), the gather path and the paged serving step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class LowRank(NamedTuple):
  """n low-rank updates of one [in, out] weight, kept apart from it."""
  a: jax.Array  # [n, in, r]
  b: jax.Array  # [n, r, out], each update's scale (alpha / r) folded in
  rows: jax.Array | None = None  # [b, n] 0/1: which rows take which update; None: every row takes all n


def _masked(h: jax.Array, lr: LowRank, dtype) -> jax.Array:
  """h [b,...,n,r] with row b's updates not its own zeroed (lr.rows [b,n] broadcast over the middle axes), in dtype."""
  if lr.rows is not None:
    b, n = lr.rows.shape
    h = h * lr.rows.astype(h.dtype).reshape(b, *(1,) * (h.ndim - 3), n, 1)  # [b,(1,..),n,1]
  return h.astype(dtype)


def delta(x: jax.Array, lr: LowRank, dtype, precision=None) -> jax.Array:
  """x [b,...,in] -> the updates' term [b,...,out] fp32: sum_k m[b,k] (x A_k) B_k, inputs cast to dtype."""
  h = jnp.einsum("b...i,nir->b...nr", x.astype(dtype), lr.a.astype(dtype), precision=precision,
                 preferred_element_type=F32)  # [b,...,n,r]
  h = _masked(h, lr, dtype)
  return jnp.einsum("b...nr,nro->b...o", h, lr.b.astype(dtype), precision=precision,
                    preferred_element_type=F32)  # [b,...,out]


def _split_b(b: jax.Array, heads: int, nope: int) -> tuple[jax.Array, jax.Array]:
  """wkv_b's B [n, r, h*(nope+v)] -> its key part [n,r,h,nope] and value part [n,r,h,v]."""
  n, r, _ = b.shape
  per_head = b.reshape(n, r, heads, -1)  # [n,r,h,nope+v]
  return per_head[..., :nope], per_head[..., nope:]


def absorbed_q_delta(q_nope: jax.Array, lr: LowRank, nope: int, dtype, precision=None) -> jax.Array:
  """Absorbed MLA's query through wkv_b's updates: q_nope [b,t,h,nope], A [n,c,r], B [n,r,h*(nope+v)] -> [b,t,h,c]
  fp32, the term (A B)_key adds to q_lat = q_nope . w_uk (sparse_attention.absorb_q)."""
  b_key, _ = _split_b(lr.b.astype(dtype), q_nope.shape[2], nope)  # [n,r,h,nope]
  u = jnp.einsum("bthd,nrhd->bthnr", q_nope.astype(dtype), b_key, precision=precision,
                 preferred_element_type=F32)  # [b,t,h,n,r]
  u = _masked(u, lr, dtype)
  return jnp.einsum("bthnr,ncr->bthc", u, lr.a.astype(dtype), precision=precision,
                    preferred_element_type=F32)  # [b,t,h,c]


def absorbed_out_delta(o_lat: jax.Array, lr: LowRank, nope: int, dtype, precision=None) -> jax.Array:
  """Absorbed MLA's output through wkv_b's updates: o_lat [b,t,h,c], A [n,c,r], B [n,r,h*(nope+v)] -> [b,t,h,v]
  fp32, the term (A B)_value adds to out = o_lat . w_uv (sparse_attention.unabsorb_out)."""
  _, b_value = _split_b(lr.b.astype(dtype), o_lat.shape[2], nope)  # [n,r,h,v]
  w = jnp.einsum("bthc,ncr->bthnr", o_lat.astype(dtype), lr.a.astype(dtype), precision=precision,
                 preferred_element_type=F32)  # [b,t,h,n,r]
  w = _masked(w, lr, dtype)
  return jnp.einsum("bthnr,nrhv->bthv", w, b_value, precision=precision, preferred_element_type=F32)  # [b,t,h,v]


__all__ = ["LowRank", "delta", "absorbed_q_delta", "absorbed_out_delta"]
