"""MaxText/kernels/selection_keys.py: the exact k-th int32 key by bisection, and cache-sized row
blocks whose outputs (arrays and Columns of pieces) are written in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import backend
from MaxText.kernels import selection_keys as sk

pytestmark = pytest.mark.device  # runs unchanged on one GPU or TPU (tools/device/device_check.sh)


def test_kth_key_at_a_width_padded_off_the_l1_set_stride():
  """n = 16 * 1024 keys would put the 16 counting rows 4 KiB apart (one L1 set): _rows_of_16 pads
  them to 1040 wide; the k-th is still exact, ties and the padding included."""
  rng = np.random.default_rng(5)
  kth = jax.jit(jax.vmap(sk._kth_key, in_axes=(0, None)), static_argnums=1)
  for n in (16384, 16384 - 21):
    assert sk._rows_of_16(jnp.zeros((n,), jnp.int32)).shape == (16, 1040 if n == 16384 else 1023)
    keys = np.stack([rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32),
                     rng.integers(-3, 3, n).astype(np.int32)])  # [2,n]: random, heavy ties
    for k in (1, 2048, n):
      want = np.sort(keys, axis=1)[:, ::-1][:, k - 1]
      np.testing.assert_array_equal(kth(jnp.asarray(keys), k), want)


def test_map_blocks_writes_column_pieces_and_vectors_in_place_with_padded_blocks():
  """A block function returning Columns (pieces of uneven widths, side by side) and a per-row
  vector: written piece by piece into each output (row_blocks "cache", the CPU's; forced here on
  any backend); 21 rows at 2 rows per block (s=131072) pad the last block. Equal to the function
  applied to all rows at once."""
  s = 131072
  assert sk._block_rows(s, sk._CACHE_BYTES) == 2
  x = jax.random.normal(jax.random.key(2), (3, 7, s), jnp.float32)

  def block_fn(b):  # [R,s] -> (Columns of [R,100], [R,s-107], [R,7] pieces; [R])
    pieces = sk.Columns((b[:, :100] > 0, b[:, 100:s - 7] > 1, b[:, s - 7:] < 0))
    return pieces, jnp.sum(b > 0, axis=1)

  with backend.forced(row_blocks="cache"):
    mask, count = jax.jit(lambda x: sk._map_blocks(block_fn, x))(x)
  want_mask, want_count = block_fn(x.reshape(-1, s))
  np.testing.assert_array_equal(np.asarray(mask).reshape(-1, s), np.asarray(want_mask.join()))
  np.testing.assert_array_equal(np.asarray(count).reshape(-1), np.asarray(want_count))
  assert mask.shape == (3, 7, s) and count.shape == (3, 7)
