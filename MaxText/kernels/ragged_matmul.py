"""The grouped matmul of the routed experts (`jax.lax.ragged_dot`) with a batching rule a TPU compiles.

`matmul(lhs [M,K], rhs [G,K,N], group_sizes [G])` is `jax.lax.ragged_dot`: rows 0 .. gs[0]-1 by rhs[0],
the next gs[1] by rhs[1], ...; rows past sum(gs) are 0 (and get no gradient). Its gradients are two more grouped
products of the same groups: d lhs = matmul(g, rhs^T), d rhs[i] = lhs[rows of i]^T g[rows of i]
(`transposed`, ragged_dot_general with the ragged dimension contracted).

Why not jax.lax.ragged_dot itself: under `jax.vmap` (the pipeline's vmap over stages, layers/pipeline.py) jax's
batching rule gives ragged_dot_general a batch dimension, which XLA:TPU's grouped matmul refuses ("Failed to create
RaggedConvSpec ...: number of batch dimensions should be 0, got 1"; the pipelined step did not compile for a TPU).
Here a batch of B problems folds into one: lhs [B*M,K] by rhs [B*G,K,N] with group sizes [B*G], where each
problem's last group also takes its rows past sum(gs[b]) (so problem b's rows stay in problem b's groups) and those
rows' outputs are zeroed after, as ragged_dot leaves them. Each rule calls this module's functions again, so vmap
nests. The same arithmetic, in one grouped product: no batch dimension reaches the compiler.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

# d rhs: the rows (lhs dim 0) are both the ragged and the contracting dimension; rhs is g [M,N], no group dimension
_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _batched(axis_size: int, in_batched, args):
  """Every argument with the vmapped axis in front (an unbatched one broadcast)."""
  return [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]


def _fold_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
  """gs [B,G] -> [B*G]: problem b's last group also takes its rows past sum(gs[b]), so each problem's M rows stay
  in its own groups when the B problems are laid one after another."""
  extra = rows - jnp.sum(group_sizes, axis=1)  # [B]
  return group_sizes.at[:, -1].add(extra).reshape(-1)  # [B*G]


def _in_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """[B,M,1]: row m of problem b lies in a group (m < sum(gs[b]))."""
  return (jnp.arange(rows)[None, :] < jnp.sum(group_sizes, axis=1)[:, None])[..., None]


@functools.cache
def _products(precision):
  """matmul's differentiable product and transposed's for one precision (a static argument of each rule)."""

  @custom_vmap
  def mm(lhs, rhs, group_sizes):  # [M,K], [G,K,N], [G] -> [M,N] in lhs.dtype
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)

  @mm.def_vmap
  def _(axis_size, in_batched, lhs, rhs, group_sizes):
    lhs, rhs, group_sizes = _batched(axis_size, in_batched, (lhs, rhs, group_sizes))  # [B,M,K], [B,G,K,N], [B,G]
    b, m, k = lhs.shape
    out = matmul(lhs.reshape(b * m, k), rhs.reshape((-1,) + rhs.shape[2:]), _fold_sizes(group_sizes, m),
                 precision=precision)  # [B*M,N]
    out = out.reshape(b, m, -1)  # [B,M,N]
    return jnp.where(_in_groups(group_sizes, m), out, jnp.zeros_like(out)), True

  @custom_vmap
  def tmm(lhs, g, group_sizes):  # [M,K], [M,N], [G] -> [G,K,N] f32: per group, its rows' lhs^T g
    return jax.lax.ragged_dot_general(lhs, g, group_sizes, _TRANSPOSED, precision=precision,
                                      preferred_element_type=jnp.float32)

  @tmm.def_vmap
  def _(axis_size, in_batched, lhs, g, group_sizes):
    lhs, g, group_sizes = _batched(axis_size, in_batched, (lhs, g, group_sizes))  # [B,M,K], [B,M,N], [B,G]
    b, m, k = lhs.shape
    g = jnp.where(_in_groups(group_sizes, m), g, jnp.zeros_like(g))  # rows past the groups: no gradient
    out = transposed(lhs.reshape(b * m, k), g.reshape(b * m, -1), _fold_sizes(group_sizes, m),
                     precision=precision)  # [B*G,K,N]
    return out.reshape((b, -1) + out.shape[1:]), True  # [B,G,K,N]

  @jax.custom_vjp
  def product(lhs, rhs, group_sizes):
    return mm(lhs, rhs, group_sizes)

  def fwd(lhs, rhs, group_sizes):
    return mm(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, g):  # g [M,N]
    lhs, rhs, group_sizes = res
    d_lhs = mm(g.astype(lhs.dtype), jnp.swapaxes(rhs, -1, -2).astype(lhs.dtype), group_sizes)  # [M,K]
    d_rhs = tmm(lhs, g.astype(lhs.dtype), group_sizes).astype(rhs.dtype)  # [G,K,N]
    return d_lhs, d_rhs, None

  product.defvjp(fwd, bwd)
  return product, tmm


def _varying_alike(*xs: jax.Array) -> list[jax.Array]:
  """Inside a shard_map: each operand made varying over every mesh axis any of them varies over (lhs [M,K] over
  fsdp and rhs [G,K,N] over tensor too, the tensor-parallel MoE). A custom_vjp's backward must return each
  cotangent with its operand's type, and d lhs = g rhs^T varies wherever rhs does; made so before the product,
  the cast's own transpose sums the cotangent over the axes it added (what jax.lax.ragged_dot's autodiff does)."""
  vma = [jax.typeof(x).manual_axis_type.varying for x in xs]  # empty outside a shard_map
  union = frozenset().union(*vma)
  return [x if v == union else jax.lax.pcast(x, tuple(sorted(union - v)), to="varying") for x, v in zip(xs, vma)]


def matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision=None) -> jax.Array:
  """jax.lax.ragged_dot(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> [M,N] in lhs.dtype (rhs cast to it), batched
  by folding into one grouped product (module doc); differentiable in lhs and rhs."""
  lhs, rhs, group_sizes = _varying_alike(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))
  return _products(precision)[0](lhs, rhs, group_sizes)


def transposed(lhs: jax.Array, g: jax.Array, group_sizes: jax.Array, *, precision=None) -> jax.Array:
  """Per group i, lhs[rows of i]^T @ g[rows of i]: lhs [M,K], g [M,N], group_sizes [G] -> [G,K,N] f32 (the
  grouped matmul's weight gradient), batched by folding (module doc). Not differentiable."""
  return _products(precision)[1](lhs, g, group_sizes.astype(jnp.int32))
