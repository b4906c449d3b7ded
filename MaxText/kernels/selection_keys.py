"""The machinery top-k selection (selection.py) runs on: order-preserving int32 keys of f32 scores,
cache-sized blocks of rows on CPU (_map_blocks, _repair_rows; row_blocks in backend.py), counting
and the exact k-th key by bisection (_kth_key), and a prefix sum that XLA:CPU runs fast. Pure
functions of arrays and static Python arguments; shapes [R, n] are a block of R rows of n keys."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.kernels import backend

_IMIN, _IMAX = -(2**31), 2**31 - 1
_INF_BITS = 0x7F800000  # bit pattern of +inf
_ROT = _IMAX - _INF_BITS  # rotates the +NaN keys (above +inf) to the very bottom
_NEG_INF_KEY = (_INF_BITS ^ _IMIN ^ _IMAX) + _ROT  # _to_keys(-inf); every NaN key is below it
_CACHE_BYTES = 1 << 20  # per-block int32 keys kept under this (the L2 of one core)


def _to_keys(x: jax.Array) -> jax.Array:
  """f32 -> int32 keys whose signed order is lax.top_k's order (-0 < +0), with every NaN below -inf.

  Flipping the magnitude bits of negative floats makes the int order the float order; adding
  _ROT (wrapping) moves the +NaN block from the top to the bottom. Integer compares also keep
  XLA:CPU on its vectorized loop emitter (float selects inside reductions are not).
  """
  i = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return (i ^ ((i >> 31) & _IMAX)) + _ROT


def _from_keys(key: jax.Array) -> jax.Array:
  """Inverse of _to_keys; a NaN key comes back as -inf."""
  i = jnp.maximum(key, _NEG_INF_KEY) - _ROT
  return lax.bitcast_convert_type(i ^ ((i >> 31) & _IMAX), jnp.float32)


def _sanitize(x: jax.Array) -> jax.Array:
  """NaN -> -inf (for the lax.top_k / approx_max_k paths)."""
  x = x.astype(jnp.float32)
  return jnp.where(jnp.isnan(x), -jnp.inf, x)


def _pad_last(x: jax.Array, multiple: int, value) -> jax.Array:
  pad = -x.shape[-1] % multiple
  return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


def _block_rows(s: int, cache_bytes: int) -> int:
  """Rows per block on CPU: a power of two whose int32 keys fit cache_bytes (1 to 64)."""
  return max(1, min(64, 2 ** int(math.log2(max(1, cache_bytes // (4 * s))))))


@jax.tree_util.register_pytree_node_class
class Columns(tuple):
  """A block function's output given as [R, w_i] pieces that stand side by side in one [R, sum w_i]
  array. _map_blocks writes each piece in place on CPU: a concatenate of them is a copy of the
  block that XLA:CPU does not fuse into the write (docs/measured_choices.md; benchmarks/indexer_topk.py)."""

  def join(self) -> jax.Array:
    return self[0] if len(self) == 1 else jnp.concatenate(self, axis=1)

  def tree_flatten(self):
    return tuple(self), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(children)


def _is_columns(o) -> bool:
  return isinstance(o, Columns)


def _as_columns(o) -> Columns:
  return o if _is_columns(o) else Columns((o,))


def _map_blocks(block_fn, *arrays: jax.Array, cache_bytes: int = _CACHE_BYTES):
  """Apply block_fn to blocks of rows: arrays [..., n_i] (same batch dims) -> outputs [..., *].

  block_fn takes [R, n_i] arrays and returns arrays [R, *] or Columns of [R, w_i] pieces. With
  row_blocks "cache" (CPU; backend.py) R = _block_rows(s, cache_bytes) and the blocks run one after
  another in a loop (not vmap, so a lax.cond in block_fn stays a branch per block) that writes each
  block's outputs, piece by piece, in place, each block's working set staying in cache through every
  pass. "all" (portable): one block.
  """
  batch = arrays[0].shape[:-1]
  rows = [a.reshape(-1, a.shape[-1]) for a in arrays]  # [N, n_i]
  n = rows[0].shape[0]
  r = _block_rows(arrays[0].shape[-1], cache_bytes) if backend.choice("row_blocks") == "cache" else n
  if r >= n:
    out = jax.tree.map(lambda o: o.join() if _is_columns(o) else o, block_fn(*rows), is_leaf=_is_columns)
  else:
    pad = -n % r  # rare (batch not a multiple of R): pad with -inf rows, sliced off below
    rows = [jnp.pad(a, ((0, pad), (0, 0)), constant_values=-jnp.inf) if pad else a for a in rows]
    shapes, tree = jax.tree.flatten(jax.eval_shape(block_fn, *[a[:r] for a in rows]), is_leaf=_is_columns)
    init = [jnp.zeros((n + pad,) + ((sum(p.shape[1] for p in c),) + c[0].shape[2:] if c[0].ndim > 1 else ()),
                      c[0].dtype) for c in map(_as_columns, shapes)]  # each output, [N, ...]

    def write(i, outs):  # block i's outputs into rows i*R .. i*R + R - 1 of outs, piece by piece
      res = jax.tree.leaves(block_fn(*[lax.dynamic_slice_in_dim(a, i * r, r) for a in rows]), is_leaf=_is_columns)
      new = []
      for o, c in zip(outs, map(_as_columns, res)):
        col = 0
        for p in c:  # [R, w, ...] at column col, or [R]
          o = lax.dynamic_update_slice(o, p, (i * r,) + ((col,) + (0,) * (p.ndim - 2) if p.ndim > 1 else ()))
          col += p.shape[1] if p.ndim > 1 else 0
        new.append(o)
      return new

    out = jax.tree.unflatten(tree, [o[:n] for o in lax.fori_loop(0, (n + pad) // r, write, init)])
  return jax.tree.map(lambda o: o.reshape(*batch, *o.shape[1:]), out)


def _count_ge(keys: jax.Array, v: jax.Array) -> jax.Array:
  """#(keys >= v) for keys [..., 16, X] and v [...] (a scalar per row) -> [...] int32.

  Reducing the 16-long axis first vectorizes over X on XLA:CPU; the barrier stops XLA from
  merging the two reductions into one that its CPU emitter does not vectorize.
  """
  partial = jnp.sum((keys >= v[..., None, None]).astype(jnp.int32), axis=-2)  # [..., X]
  return jnp.sum(lax.optimization_barrier(partial), axis=-1)


def _rows_of_16(keys: jax.Array) -> jax.Array:
  """keys [n] -> [16, width] (IMIN pads, which never raise a count), for _count_ge."""
  width = -(-keys.shape[0] // 16)
  if width % 1024 == 0:  # rows 4 KiB apart share one L1 set (16 > its 8 ways): docs/measured_choices.md
    width += 16
  return _pad_last(keys, 16 * width, _IMIN).reshape(16, width)


def _kth_key(keys: jax.Array, kk) -> jax.Array:
  """The kk-th largest of keys [n] (an int32 key): the largest v with #(keys >= v) >= kk.

  Built bit by bit from the top in the offset encoding u = v - INT_MIN, so 32 counting passes
  find it exactly, ties included, with no sort and nothing data dependent. kk <= n.
  """
  keys_16x = _rows_of_16(keys)  # [16, n/16]

  def step(b, u):
    trial = u | jnp.left_shift(jnp.int32(1), 31 - b)  # int32 wraps: bit 31 is the sign bit
    return jnp.where(_count_ge(keys_16x, trial ^ _IMIN) >= kk, trial, u)

  return lax.fori_loop(0, 32, step, jnp.int32(0)) ^ _IMIN


def _exclusive_cumsum(c: jax.Array, block: int = 32) -> jax.Array:
  """Exclusive prefix sum over the last axis of small non-negative ints, by triangular matmuls.

  XLA:CPU's cumsum is a slow reduce-window; [block,block] upper-triangular products (recursing
  on the block totals) are exact in f32 below 2^24, at HIGHEST precision (no bf16/tf32 passes).
  """
  dot = lambda a, b: jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
  n = c.shape[-1]
  cf = _pad_last(c.astype(jnp.float32), block, 0).reshape(*c.shape[:-1], -1, block)  # [..., n/B, B]
  upper = jnp.triu(jnp.ones((block, block), jnp.float32), 1)
  within = dot(cf, upper)  # [..., n/B, B]: sum of the earlier entries of each block
  totals = cf.sum(-1)  # [..., n/B]
  if totals.shape[-1] > block:
    offsets = _exclusive_cumsum(totals, block)
  else:
    nb = totals.shape[-1]
    offsets = dot(totals, jnp.triu(jnp.ones((nb, nb), jnp.float32), 1))  # [..., n/B]
  out = (within + offsets[..., None]).reshape(*c.shape[:-1], -1)[..., :n]
  return out.astype(jnp.int32)


def _repair_rows(scores: jax.Array, mask: jax.Array, bad: jax.Array, full_block_fn) -> jax.Array:
  """mask [..., s] with the rows where bad [...] is True rewritten by full_block_fn ([R,s] -> bool
  [R,s], the same set computed without shortcuts), a cache block of bad rows at a time; a while
  loop that runs no block where no row is bad."""
  s = scores.shape[-1]
  x, mask, bad = scores.reshape(-1, s), mask.reshape(-1, s), bad.reshape(-1)  # [N,s], [N,s], [N]
  n = x.shape[0]
  m = min(n, _block_rows(s, _CACHE_BYTES))

  def repair(state):  # the first m rows still bad (index n: none, dropped)
    mask, bad = state
    idx = jnp.nonzero(bad, size=m, fill_value=n)[0]  # [m]
    fixed = full_block_fn(x[jnp.minimum(idx, n - 1)])  # [m,s]
    return mask.at[idx].set(fixed, mode="drop"), bad.at[idx].set(False, mode="drop")

  mask, _ = lax.while_loop(lambda state: jnp.any(state[1]), repair, (mask, bad))
  return mask.reshape(scores.shape)
