"""Which keys a query may see: causal by original position, same segment, no padding.

Causality compares ORIGINAL token positions, never array indices: context parallelism
reorders the sequence (zig-zag load balancing), and the mask must stay the same.
"""

from __future__ import annotations

import jax


def attention_validity(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None = None,
                       k_seg: jax.Array | None = None) -> jax.Array:
  """q_pos [b,t], k_pos [b,s] (int positions); q_seg [b,t], k_seg [b,s] | None -> bool [b,t,s], True = may attend.

  A key is visible when k_pos <= q_pos, it lies in the query's segment, and its segment is
  not 0 (0 marks padding). Segments None means one segment and no padding. A padding query
  (segment 0) sees nothing: its row is all False.
  """
  if (q_seg is None) != (k_seg is None):
    raise ValueError("attention_validity: pass both q_seg and k_seg, or neither "
                     f"(got q_seg={'None' if q_seg is None else q_seg.shape}, "
                     f"k_seg={'None' if k_seg is None else k_seg.shape})")
  valid = k_pos[:, None, :] <= q_pos[:, :, None]  # [b,t,s]
  if q_seg is not None:
    same = q_seg[:, :, None] == k_seg[:, None, :]  # [b,t,s]
    valid = valid & same & (k_seg[:, None, :] != 0)
  return valid
