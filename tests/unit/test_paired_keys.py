"""backend.py's key_order "paired" (the tpu row): a paged fp8 idx_k pool held as int8 with each 256-slot group's
rows in paired order (fp8_blocks.paired_rows) and its subnormal codes flushed; the scoring kernel's bf16 keys by
word ops (paged_decode._paired_bf16), against the natural pool and the XLA reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText.inference import kv_cache, paged_cache, paged_pools
from MaxText.kernels import backend
from MaxText.kernels import paged_decode as pd
from MaxText.kernels.fp8_blocks import PAIR_GROUP, flush_subnormals, natural_rows, paired_rows
from tests.conftest import make_config

PAGE = PAIR_GROUP  # one group a page
B, P = 2, 3
N = B * P * PAGE


def test_paired_rows_permute_each_group_and_natural_rows_undo_them():
  slots = np.arange(3 * PAIR_GROUP)
  rows = np.asarray(paired_rows(jnp.asarray(slots)))
  for g in range(3):  # a bijection of each group onto its own rows
    assert sorted(rows[g * PAIR_GROUP:(g + 1) * PAIR_GROUP]) == list(range(g * PAIR_GROUP, (g + 1) * PAIR_GROUP))
  # the layout the kernel's shifts assume: word i (rows 4i .. 4i+3) holds slots 2i, 128+2i, 2i+1, 128+2i+1 in bytes
  # 0 .. 3 (first half's pair in bytes 0 and 2, second half's in 1 and 3); the group's last slot in its last row
  assert list(rows[[0, 128, 1, 129, 2, 255, 256]]) == [0, 1, 2, 3, 4, 255, 256]
  assert int(paired_rows(jnp.int32(4 * PAIR_GROUP))) == 4 * PAIR_GROUP  # the pool's drop slot N stays N
  stored = np.empty((3 * PAIR_GROUP, 2), np.int32)
  stored[rows] = np.stack([slots, -slots], axis=1)  # slot s written at its row
  np.testing.assert_array_equal(natural_rows(jnp.asarray(stored)), np.stack([slots, -slots], axis=1))
  np.testing.assert_array_equal(natural_rows(jnp.asarray(stored)[None].repeat(2, 0), axis=1)[1], stored[rows])


def test_flush_subnormals_zeroes_exactly_the_subnormal_codes_keeping_their_sign():
  codes = np.arange(256, dtype=np.uint8)
  values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(flush_subnormals(jnp.asarray(codes)))
  sub = (codes & 0x78) == 0  # exponent bits 0: +-0 and the 14 subnormals
  np.testing.assert_array_equal(got[~sub], codes[~sub])  # normals (448, NaN 0x7f/0xff too) untouched
  np.testing.assert_array_equal(got[sub], codes[sub] & 0x80)
  assert np.all(np.abs(values[sub]) < 2.0 ** -6) and np.all(np.abs(values[~sub & ~np.isnan(values)]) >= 2.0 ** -6)
  as_int8 = flush_subnormals(jnp.asarray(codes.view(np.int8)))
  assert as_int8.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(as_int8).view(np.uint8), got)


def test_the_kernels_word_decoding_is_every_normal_codes_value_times_2_to_the_minus_120():
  codes = np.arange(256, dtype=np.uint8)
  normal = ((codes & 0x78) != 0) & ((codes & 0x7F) != 0x7F)
  codes = np.concatenate([codes[normal], np.array([0x00, 0x80], np.uint8)])  # and +-0
  n = 4 * len(codes)
  block = np.zeros((n, 128), np.uint8)  # rows 4i + j: byte j of word i
  block[:, 0] = np.tile(codes, 4)
  block[:, 1] = np.roll(np.tile(codes, 4), 7)
  words = jax.lax.bitcast_convert_type(jnp.asarray(block).reshape(n // 4, 4, 128).transpose(0, 2, 1), jnp.uint32)
  first, second = jax.jit(pd._paired_bf16)(words)  # [n/2, 128] bf16: rows 2i, 2i+1 = bytes (0, 2), (1, 3) of word i
  want = block.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2.0 ** -120  # [n, 128]
  np.testing.assert_array_equal(np.asarray(first, np.float32), want.reshape(n // 4, 4, 128)[:, [0, 2]].reshape(n // 2, 128))
  np.testing.assert_array_equal(np.asarray(second, np.float32), want.reshape(n // 4, 4, 128)[:, [1, 3]].reshape(n // 2, 128))


@pytest.fixture(scope="module")
def pools():
  """The same fp8 keys as a natural (uint8) pool and a paired (int8) one, both with subnormal codes flushed (what a
  paired pool holds), 2 rows of 3 pages of 256 slots, the table a permutation."""
  k = jax.random.split(jax.random.key(3), 3)
  keys = jax.random.normal(k[0], (N, 128)) * jnp.exp2(jax.random.uniform(k[1], (N, 1), minval=-8, maxval=4))
  keys = keys.at[:, :8].multiply(1e-5)  # some codes subnormal before the flush
  codes, scale = kv_cache.quantize_fp8(keys)
  bits = flush_subnormals(jax.lax.bitcast_convert_type(codes, jnp.uint8))  # [N,128]
  paired = jnp.zeros((N, 128), jnp.int8).at[paired_rows(jnp.arange(N))].set(jax.lax.bitcast_convert_type(bits, jnp.int8))
  table = jnp.asarray(np.random.default_rng(1).permutation(B * P).reshape(B, P), jnp.int32)
  return dict(natural=bits, paired=paired, scale=scale, table=table, pos=jnp.array([P * PAGE - 1, 300]),
              q=jax.random.normal(k[2], (B, 4, 128)), w=jnp.array([[0.5, -0.2, 0.3, 0.1], [0.2, 0.4, -0.1, 0.3]]))


@pytest.mark.parametrize("queries", ["bf16", "f32", "fp8_bits"])
def test_the_paired_kernel_scores_as_the_natural_pools_xla_path(pools, queries):
  c = pools
  q, q_scale, w = c["q"], None, c["w"]
  if queries == "bf16":
    q, w = pd.fp8_scored_queries(q, w)
  elif queries == "fp8_bits":
    q, q_scale = pd.fp8_queries(q)
  ref = pd.paged_index_scores_xla(q, q_scale, w, c["natural"], c["scale"], c["table"], c["pos"], PAGE)
  for ppb in (1, 3):
    got = pd.paged_index_scores(q, q_scale, w, c["paired"], c["scale"], c["table"], c["pos"], PAGE,
                                pages_per_block=ppb, interpret=True)
    got, want = np.asarray(got), np.asarray(ref)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isinf(got[1, 301:]).all() and np.isfinite(got[1, :301]).all()  # past pos: -inf
    fin = np.isfinite(want)
    assert np.max(np.abs(got[fin] - want[fin])) <= 1e-5 * np.max(np.abs(want[fin]))
  # the paired pool's own XLA reference reads it back in slot order
  np.testing.assert_array_equal(pd.paged_index_scores_xla(q, q_scale, w, c["paired"], c["scale"], c["table"], c["pos"],
                                                          PAGE), ref)
  with pytest.raises(ValueError, match="paired"):
    pd.paged_index_scores(q, q_scale, w, c["paired"][:N // 2].reshape(-1, 128), c["scale"][:N // 2], c["table"] % 3,
                          c["pos"], PAGE // 2, pages_per_block=1, interpret=True)


def _config(page: int, dtype: str = "fp8"):
  return make_config(kv_cache_dtype=dtype, indexer_head_dim=128, serve_page_size=page, max_target_length=1024)


def test_pools_are_paired_only_under_the_way_for_fp8_keys_of_one_block_in_whole_groups():
  with backend.forced(key_order="paired"):
    assert paged_pools.init_layer_pools(_config(256), 512).idx_k.dtype == jnp.int8
    assert paged_pools.init_layer_pools(_config(64), 512).idx_k.dtype == jnp.uint8  # pages of part of a group
    bf16 = _config(256, "bfloat16")
    assert paged_pools.init_layer_pools(bf16, 512).idx_k.dtype == jnp.uint16
  with backend.forced(key_order="natural"):
    assert paged_pools.init_layer_pools(_config(256), 512).idx_k.dtype == jnp.uint8


def test_a_paired_pool_written_and_read_through_the_pages_equals_the_natural_one(pools):
  """paged_pools.write places each slot at its paired row (flushing subnormals); page_values and PagedKeys' XLA
  and kernel paths read the pages back in slot order: the same scores as over the natural pool."""
  c = pools
  cfg = _config(PAGE)
  x = jax.random.normal(jax.random.key(5), (B, 5, 128)).at[:, :, :4].multiply(1e-6)  # [B,t,d] new keys
  slot_ids = jnp.array([[0, 1, 128, 255, 256], [767, 512, 300, 2, N]])  # group edges; N: dropped
  out = {}
  for order in ("natural", "paired"):
    with backend.forced(key_order=order):
      pool = paged_pools.init_layer_pools(cfg, N)
      pool = paged_pools.write(pool, slot_ids, idx_k=x)
      out[order] = pool
  assert out["paired"].idx_k.dtype == jnp.int8 and out["natural"].idx_k.dtype == jnp.uint8
  flushed = flush_subnormals(out["natural"].idx_k)
  assert not np.array_equal(np.asarray(flushed), np.asarray(out["natural"].idx_k))  # the natural pool keeps them
  pages = jnp.arange(N // PAGE)[None]  # [1, G]: every page
  got = paged_pools.page_values(out["paired"].idx_k, pages, PAGE)[0]
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)), np.asarray(flushed))
  np.testing.assert_array_equal(out["paired"].idx_k_scale, out["natural"].idx_k_scale)
  q, w, pos = c["q"][:, None], c["w"][:, None], c["pos"][:, None]
  src = {k: paged_cache.PagedKeys(v.idx_k, v.idx_k_scale, c["table"], PAGE) for k, v in out.items()}
  natural = jax.jit(lambda *a: src["natural"].scores(*a, head_chunk=4))(q, w, pos)
  paired_xla = jax.jit(lambda *a: src["paired"].scores(*a, head_chunk=4))(q, w, pos)
  with backend.forced(paged_scoring="pallas"):
    paired_kernel = jax.jit(lambda *a: src["paired"].scores(*a, head_chunk=4))(q, w, pos)
  for got in (paired_xla, paired_kernel):
    got, want = np.asarray(got), np.asarray(natural)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    assert np.max(np.abs(got[fin] - want[fin])) <= 1e-3 * np.max(np.abs(want[fin]))  # the flushed codes' share


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_the_engine_over_paired_pools_decodes_the_tokens_it_does_over_natural_ones():
  """The serving engine with the tpu row's paired idx_k pool (int8; prefill scored by the XLA path over pages read
  back in slot order, decode by the paired kernel, interpreted here) gives the greedy tokens of the natural pool,
  the selection mattering (top-k 8 of up to 40 keys)."""
  from MaxText.checkpoint import model_state
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  from tests.support.serving import BASE, NEW, PROMPTS
  cfg = make_config(**{**BASE, "kv_cache_dtype": "fp8", "indexer_head_dim": 128, "serve_page_size": 256,
                       "serve_num_pages": 8})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  out = {}
  for order in ("natural", "paired"):
    with backend.forced(key_order=order, paged_scoring="pallas"):
      eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
      out[order] = [r.output for r in eng.generate(PROMPTS[:4], SamplingParams(max_tokens=NEW))]
    assert eng.pools["dense_layers"].idx_k.dtype == (jnp.int8 if order == "paired" else jnp.uint8)
  assert out["paired"] == out["natural"]
  assert all(len(o) == NEW for o in out["paired"])
