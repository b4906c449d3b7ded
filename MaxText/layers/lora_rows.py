"""Per-row LoRA adapters in one batch (serving many adapters; vLLM's multi-LoRA, punica's idea).

A served model with `serve_lora_adapters` holds, in every adapted Linear, the adapters stacked on a slot axis:

    A [n, in, r]    B [n, r, out]    n = adapters + 1; slot 0 is zeros (no adapter); slot k is the k-th entry
                                     of serve_lora_adapters, its rank padded with zeros to the largest r and its
                                     alpha_k / r_k folded into B (so no scale is applied here)

(a scanned stack: [L, n, in, r], the scan hands each layer its [n, in, r]). Each row of a step picks a slot
(step_feed's `adapter` [b]), made known to every adapted Linear of the model call by `row_adapters(slots)`
around it. The delta is a batched contraction over the slot axis with the rows' one-hot slot masks:

    h[b,..,k,r] = x[b,..,i] A[k,i,r] * onehot(slot_b)[k]        d[b,..,o] = h[b,..,k,r] B[k,r,o]

(k over the adapters' slots 1 .. n - 1: slot 0 is zeros and never computed), so one compiled step serves any mix
of adapters (no recompile, no per-row copy of a weight); its cost is (n - 1) x (in + out) x r multiply-adds a
token: every row pays for every adapter (a per-row gather of A and B would cost one adapter's multiply-adds but
move rows x (in + out) x r weights). A row whose slot is 0 adds exactly zero: the base's output. Absorbed MLA (the cache path
never forms wkv_b x) takes its per-row deltas in the absorbed space, `absorbed_q_delta` / `absorbed_out_delta`:
the same W + A B, contracted in another order.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_SLOTS: contextvars.ContextVar = contextvars.ContextVar("lora_row_slots", default=None)


@contextlib.contextmanager
def row_adapters(slots: jax.Array):
  """Inside: adapted Linears holding slot-stacked adapters apply row b's adapter slots[b] ([b] int32) to row b of
  their input. Set around the model call of a traced step (the scan over layers traces inside it)."""
  token = _SLOTS.set(slots)
  try:
    yield
  finally:
    _SLOTS.reset(token)


def _mask(b: int, n: int, dtype) -> jax.Array:
  """The rows' one-hot masks [b, n - 1] over the adapters' slots 1 .. n - 1 (slot 0, zeros, is never computed: its
  rows' masks are all zero), from the slots of the enclosing `row_adapters`."""
  slots = _SLOTS.get()
  if slots is None:
    raise ValueError("a Linear with slot-stacked LoRA adapters (serve_lora_adapters) was called outside "
                     "lora_rows.row_adapters(slots): which row takes which adapter is unknown")
  if slots.shape != (b,):
    raise ValueError(f"row_adapters holds {slots.shape} slots for an input of {b} rows")
  return jax.nn.one_hot(slots - 1, n - 1, dtype=dtype)  # [b,n-1]: slot 0 (-1) all zeros


def delta(x: jax.Array, a: jax.Array, b: jax.Array, dtype, precision=None) -> jax.Array:
  """x [b,...,in], A [n,in,r], B [n,r,out] -> each row's adapter delta [b,...,out] (x A_slot B_slot)."""
  n, rows = a.shape[0], x.shape[0]
  a, b = a[1:], b[1:]  # [n-1,in,r], [n-1,r,out]: the adapters (slot 0 adds nothing)
  m = _mask(rows, n, dtype).reshape(rows, *(1,) * (x.ndim - 2), n - 1, 1)  # [b,(1,..),n-1,1]
  h = jnp.einsum("b...i,nir->b...nr", x.astype(dtype), a.astype(dtype), precision=precision) * m  # [b,...,n-1,r]
  return jnp.einsum("b...nr,nro->b...o", h, b.astype(dtype), precision=precision)  # [b,...,out]


def _split_b(b: jax.Array, heads: int, nope: int) -> tuple[jax.Array, jax.Array]:
  """wkv_b's B [n, r, h*(nope+v)] -> its key part [n,r,h,nope] and value part [n,r,h,v]."""
  n, r, _ = b.shape
  per_head = b.reshape(n, r, heads, -1)  # [n,r,h,nope+v]
  return per_head[..., :nope], per_head[..., nope:]


def absorbed_q_delta(q_nope: jax.Array, a: jax.Array, b: jax.Array, nope: int, dtype, precision=None) -> jax.Array:
  """Absorbed MLA's query through each row's wkv_b adapter: q_nope [b,t,h,nope], A [n,c,r], B [n,r,h*(nope+v)]
  -> [b,t,h,c], the term (A B)_key adds to q_lat = q_nope . w_uk (kernels/sparse_attention.absorb_q)."""
  rows, n, heads = q_nope.shape[0], a.shape[0], q_nope.shape[2]
  b_key, _ = _split_b(b[1:].astype(dtype), heads, nope)  # [n-1,r,h,nope]: the adapters' (slot 0 adds nothing)
  m = _mask(rows, n, dtype)[:, None, None, :, None]  # [b,1,1,n-1,1]
  u = jnp.einsum("bthd,nrhd->bthnr", q_nope.astype(dtype), b_key, precision=precision) * m  # [b,t,h,n-1,r]
  return jnp.einsum("bthnr,ncr->bthc", u, a[1:].astype(dtype), precision=precision)  # [b,t,h,c]


def absorbed_out_delta(o_lat: jax.Array, a: jax.Array, b: jax.Array, nope: int, dtype, precision=None) -> jax.Array:
  """Absorbed MLA's output through each row's wkv_b adapter: o_lat [b,t,h,c], A [n,c,r], B [n,r,h*(nope+v)]
  -> [b,t,h,v], the term (A B)_value adds to out = o_lat . w_uv (kernels/sparse_attention.unabsorb_out)."""
  rows, n, heads = o_lat.shape[0], a.shape[0], o_lat.shape[2]
  _, b_value = _split_b(b[1:].astype(dtype), heads, nope)  # [n-1,r,h,v]: the adapters' (slot 0 adds nothing)
  m = _mask(rows, n, dtype)[:, None, None, :, None]  # [b,1,1,n-1,1]
  w = jnp.einsum("bthc,ncr->bthnr", o_lat.astype(dtype), a[1:].astype(dtype), precision=precision) * m  # [b,t,h,n-1,r]
  return jnp.einsum("bthnr,nrhv->bthv", w, b_value, precision=precision)  # [b,t,h,v]


__all__ = ["row_adapters", "delta", "absorbed_q_delta", "absorbed_out_delta"]
