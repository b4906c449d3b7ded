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
never forms wkv_b x) takes its per-row deltas in the absorbed space, kernels/low_rank.absorbed_q_delta /
absorbed_out_delta: the same W + A B, contracted in another order. The contractions are kernels/low_rank.py's (a
trained model's single adapter takes the same ones, with every row taking it); this module says which row takes
which slot.
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


def slot_rows(b: int, n: int) -> jax.Array:
  """The rows' one-hot masks [b, n - 1] (fp32) over the adapters' slots 1 .. n - 1 (slot 0, zeros, is never
  computed: its rows' masks are all zero), from the slots of the enclosing `row_adapters`: the `rows` of the
  kernels.low_rank.LowRank that Linear.low_rank hands to every contraction (delta, absorbed_q/out_delta)."""
  slots = _SLOTS.get()
  if slots is None:
    raise ValueError("a Linear with slot-stacked LoRA adapters (serve_lora_adapters) was called outside "
                     "lora_rows.row_adapters(slots): which row takes which adapter is unknown")
  if slots.shape != (b,):
    raise ValueError(f"row_adapters holds {slots.shape} slots for an input of {b} rows")
  return jax.nn.one_hot(slots - 1, n - 1, dtype=jnp.float32)  # [b,n-1]: slot 0 (-1) all zeros


__all__ = ["row_adapters", "slot_rows"]
