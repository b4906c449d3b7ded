"""MaxText/kernels/cached_attention.py: the indexer's selection over a cache plus new tokens, its
score buffer bounded in bytes (serve_max_index_score_bytes) whatever the chunk x context, selects
exactly what the unbounded scoring selects; the compiled program never holds a larger array. Dense
attention over a cache: a row padded past the cache's last slot answers its real queries as if cut."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels.cached_attention import ContiguousKeys, latent_attention_dense, score_blocks, select_spliced
from MaxText.kernels.topk_indices import topk_indices

B, T, H, D, S, K = 2, 64, 4, 16, 512, 16  # rows, new tokens (a prefill chunk), indexer heads, dim, slots, top-k


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, H, D))
  w = jax.random.normal(ks[1], (B, T, H)) * H ** -0.5
  k_old = jax.random.normal(ks[2], (B, S, D))
  k_new = jax.random.normal(ks[3], (B, T, D))
  start = jnp.asarray([100, 470], jnp.int32)  # the chunk's first slot per row (row 1's runs past S)
  return q, w, k_old, k_new, start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # positions [B,T]


def _select(max_bytes):
  return jax.jit(lambda q, w, k_old, *a: select_spliced(q, w, ContiguousKeys(k_old), *a, lambda s: topk_indices(s, K),
                                                        head_chunk=H, max_bytes=max_bytes))


def _largest_array_bytes(hlo: str) -> int:
  """Bytes of the largest array any instruction of the compiled program produces (parameters
  excluded: they are the inputs)."""
  size = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "bf16": 2, "u8": 1, "s8": 1}
  best = 0
  for line in hlo.split("\n"):
    if " = " not in line or "parameter(" in line:
      continue
    for dt, dims in re.findall(r"\b(f32|s32|u32|pred|bf16|f16|u8|s8)\[([\d,]*)\]", line.split(" = ", 1)[1][:200]):
      n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
      best = max(best, n * size[dt])
  return best


@pytest.mark.parametrize("budget,blocks", [(128 * 1024, (28, 1)), (16 * 1024, (3, 1)), (3 * 1024, (1, 1))])
def test_a_bounded_score_buffer_selects_what_the_unbounded_one_selects(budget, blocks):
  args = _inputs()
  unbounded_bytes = B * T * H * S * 4  # [b,t,heads,S] fp32: 1 MiB
  assert score_blocks(B, T, H, S + T, H, budget) == blocks and unbounded_bytes >= 8 * budget
  want = _select(2 ** 40)(*args)
  got = _select(budget)(*args)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.where(want[1], got[0], -1), np.where(want[1], want[0], -1))
  # The compiled program: the unbounded one holds the whole [b,t,heads,S] buffer; the bounded one no
  # array over the budget (3 KiB < one query of both rows, [2,1,512] fp32: scored one row at a time),
  # apart from the inputs' fp32 copies, [b,S,d] keys = 64 KiB here.
  inputs = B * S * D * 4
  assert _largest_array_bytes(_select(2 ** 40).lower(*args).compile().as_text()) >= unbounded_bytes
  assert _largest_array_bytes(_select(budget).lower(*args).compile().as_text()) <= max(budget, inputs)
  temp = _select(budget).lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp < _select(2 ** 40).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_score_blocks_use_every_head_that_fits_before_splitting_queries():
  assert score_blocks(1, 1, 64, 131072, 64, 512 * 2 ** 20) == (1, 64)  # a decode step: all heads at once
  assert score_blocks(1, 4096, 64, 131072, 16, 512 * 2 ** 20) == (1024, 1)  # a 4K chunk at 128K context
  assert score_blocks(1, 256, 64, 8192, 16, 512 * 2 ** 20) == (256, 16)  # fits: unchanged


def test_dense_attention_of_a_row_padded_past_the_cache_equals_the_row_cut_at_its_real_tokens():
  """A wide serving step pads each row to its width from the row's start: a row starting at a cached
  prefix (start 12 of S=16 slots, width 8) runs past S. Its padding must weigh nothing: once the slots
  past S read NaN (take_along_axis's fill) and every query of the row came out NaN."""
  h, c, r, s, t, n, start = 2, 8, 4, 16, 8, 3, jnp.asarray([12], jnp.int32)  # n real tokens of t
  rng = np.random.default_rng(1)
  q_abs, q_pe, c_old, pe_old, c_new, pe_new = (rng.standard_normal(shape, np.float32) for shape in (
      (1, t, h, c), (1, t, h, r), (1, s, c), (1, s, r), (1, t, c), (1, t, r)))
  pos = start[:, None] + jnp.arange(t)[None]  # [1,t]
  valid = jnp.arange(s)[None, None, :] <= pos[:, :, None]  # [1,t,S]
  attend = jax.jit(latent_attention_dense, static_argnums=8)
  padded = attend(q_abs, q_pe, c_old, pe_old, c_new, pe_new, valid, start, 0.5)  # [1,t,h,c]
  cut = attend(q_abs[:, :n], q_pe[:, :n], c_old, pe_old, c_new[:, :n], pe_new[:, :n],
               valid[:, :n], start, 0.5)  # [1,n,h,c]
  np.testing.assert_allclose(np.asarray(padded[:, :n]), np.asarray(cut), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 3])  # a decode step's one select; a chunk's padded write
def test_splice_takes_the_new_slots_and_drops_those_past_the_end(t):
  from MaxText.kernels.cached_attention import splice
  rng = np.random.default_rng(8)
  b, h, s = 4, 2, 7
  old = rng.standard_normal((b, h, s)).astype(np.float32)
  new = rng.standard_normal((b, h, t)).astype(np.float32)
  start = np.array([0, 3, s - 1, s], np.int32)  # first slot, inside, the last slot (a chunk runs past it), past S
  got = np.asarray(jax.jit(splice)(jnp.asarray(old), jnp.asarray(new), jnp.asarray(start)))
  want = old.copy()
  for r in range(b):
    for i in range(t):
      if start[r] + i < s:
        want[r, :, start[r] + i] = new[r, :, i]
  np.testing.assert_array_equal(got, want)
