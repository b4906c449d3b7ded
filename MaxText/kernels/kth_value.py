"""Each row's k-th largest score, exactly, by a Pallas kernel that keeps the row in VMEM (Mosaic; TPU).

    kth_largest(scores [..., s] f32, k) -> [..., 1] f32     (selection.topk_threshold's value, exact_selection "pallas")

The k-th largest of a row is the largest int32 key t with #{keys >= t} >= k, over selection_keys' order-preserving
keys (_to_keys: lax.top_k's order, NaN below -inf). The kernel builds t bit by bit from the top: the sign first
(#{keys >= 0} >= k), then bits 30..0, each kept where #{keys >= t | bit} >= k still holds: 32 counts over the row,
each a compare and a lane sum over keys already in VMEM. A block of 8 rows is read from HBM once (the binned
selection of the XLA path reads a row's scores in several passes: bins, bounds, bisection, then the mask); the
counts run in chunks of CHUNK keys so that no [8, s] temporary beside the keys is live.

Rows padded to a multiple of 8 and keys to a multiple of CHUNK with -inf: a -inf key adds to a count only at a
t <= _to_keys(-inf), where the count already holds every real key (k <= s). Fewer than k finite keys in a row:
its value is -inf (a NaN key comes back as -inf), as topk_threshold's contract says. Tests: interpret mode on
the CPU against lax.top_k's k-th value (tests/unit/test_kth_value.py); the Mosaic lowering is checked by
compiling for a TPU (decode_profile --compile-for --force exact_selection=pallas; train_compile compile_topology=...). Under a mesh
of several devices (sharding.logical_rules) the kernel runs on each device's rows in a jax.shard_map (Mosaic
kernels are not partitioned by XLA): rows split as scores [b,t,s] are (activation_batch, activation_length), each
row whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from MaxText.kernels.backend import pallas_interpret
from MaxText.kernels.selection_keys import _from_keys, _to_keys
from MaxText.runtime.sharding import kernel_mesh, logical_to_spec

ROWS = 8  # rows a grid step: the f32 (8, 128) tile's sublanes
CHUNK = 8192  # keys a count step: [8, 8192] int32 = 64 vregs
_LANES = 128


def _kernel(x_ref, out_ref, keys_ref, *, k: int, chunk: int):
  """x_ref [ROWS, s] f32 scores; out_ref [ROWS, 128] int32 (each row's key, broadcast over lanes); keys_ref
  [ROWS, s] int32 scratch."""
  n = keys_ref.shape[1] // chunk

  def to_keys(c, carry):
    at = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    keys_ref[:, at] = _to_keys(x_ref[:, at])
    return carry

  jax.lax.fori_loop(0, n, to_keys, 0)

  def count_ge(t):  # t [ROWS, 1] int32 -> [ROWS, 1] int32: #{keys >= t} per row
    def body(c, acc):
      block = keys_ref[:, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)]  # [ROWS, chunk]
      return acc + jnp.sum((block >= t).astype(jnp.int32), axis=1, keepdims=True)
    return jax.lax.fori_loop(0, n, body, jnp.zeros((ROWS, 1), jnp.int32))

  zero = jnp.zeros((ROWS, 1), jnp.int32)
  ans = jnp.where(count_ge(zero) >= k, zero, jnp.full((ROWS, 1), -2**31, jnp.int32))  # the sign bit

  def bit_step(i, ans):  # bits 30 .. 0: keep each where at least k keys still reach it
    cand = ans | jnp.left_shift(jnp.int32(1), 30 - i)
    return jnp.where(count_ge(cand) >= k, cand, ans)

  ans = jax.lax.fori_loop(0, 31, bit_step, ans)
  out_ref[...] = jnp.broadcast_to(ans, (ROWS, _LANES))


def kth_largest(scores: jax.Array, k: int, *, interpret: bool | None = None) -> jax.Array:
  """scores [..., s] (NaN read as -inf), 1 <= k <= s -> [..., 1] f32: each row's k-th largest value, exactly
  lax.top_k(scores, k)[0][..., -1:] (-inf where fewer than k are finite). No gradient flows through it (the
  masks and indices it sets carry none; a training step differentiates around it)."""
  s = scores.shape[-1]
  if not 1 <= k <= s:
    raise ValueError(f"kth_largest: need 1 <= k <= {s} (the row length), got k={k}")
  active = kernel_mesh()
  if active is None:
    return _kth_local(scores, k, interpret)
  mesh, rules = active
  names = ("activation_batch", "activation_length")[:scores.ndim - 1] + (None,) * max(0, scores.ndim - 3)
  spec = logical_to_spec((*names, None), rules, mesh, scores.shape)  # [..., s]: rows split, each row whole
  return jax.shard_map(functools.partial(_kth_local, k=k, interpret=interpret), mesh=mesh, in_specs=spec,
                       out_specs=spec, check_vma=False)(scores)


def _kth_local(scores: jax.Array, k: int, interpret: bool | None) -> jax.Array:
  """kth_largest on one device's rows (shapes as there)."""
  s = scores.shape[-1]
  lead = scores.shape[:-1]
  x = jax.lax.stop_gradient(scores).reshape(-1, s).astype(jnp.float32)  # [R, s]: a selection carries no gradient
  r = x.shape[0]
  chunk = min(CHUNK, -(-s // _LANES) * _LANES)
  x = jnp.pad(x, ((0, -r % ROWS), (0, -s % chunk)), constant_values=-jnp.inf)  # [R', s']
  rows, width = x.shape
  got = pl.pallas_call(
      functools.partial(_kernel, k=k, chunk=chunk), grid=(rows // ROWS,),
      in_specs=[pl.BlockSpec((ROWS, width), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((ROWS, _LANES), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, _LANES), jnp.int32),
      scratch_shapes=[pltpu.VMEM((ROWS, width), jnp.int32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=min(100 << 20, 4 * ROWS * width * 4 + (8 << 20))),
      interpret=pallas_interpret(interpret))(x)  # [R', 128]
  return _from_keys(got[:r, :1]).reshape(*lead, 1)


__all__ = ["kth_largest"]
