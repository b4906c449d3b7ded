"""The decode cache's format: bytes per token (latent + rotary + indexer key only; what the paged
pools really allocate), the fp8 block format, ragged per-row writes into the contiguous store
(stacked and per-layer layouts), reads of only the selected rows."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText.inference import kv_cache, paged_pools
from MaxText.kernels import backend
from MaxText.kernels.paged_decode import e4m3_to_f32
from tests.conftest import make_config


def _cfg(**kw):
  kw.setdefault("max_target_length", 32)
  kw.setdefault("max_prefill_length", 16)
  return make_config(**kw)


def _allocated(pools) -> int:
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(pools))


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_bytes_per_token_per_layer_is_latent_plus_rope_plus_indexer_key(dtype, itemsize):
  cfg = _cfg(kv_cache_dtype=dtype)
  want = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.indexer_head_dim) * itemsize
  assert kv_cache.bytes_per_token_per_layer(cfg) == want
  pools = paged_pools.init_pools(cfg, 3, 8)  # what is really allocated: 3 pages of 8 tokens
  assert _allocated(pools) == want * cfg.num_decoder_layers * 3 * 8


def test_fp8_bytes_count_the_scales_and_a_bf16_rope():
  cfg = _cfg(kv_cache_dtype="fp8")
  c, r, d = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.indexer_head_dim
  want = c + 4 * -(-c // 128) + 2 * r + d + 4 * -(-d // 128)
  assert kv_cache.bytes_per_token_per_layer(cfg) == want
  assert _allocated(paged_pools.init_pools(cfg, 2, 8)) == want * cfg.num_decoder_layers * 2 * 8
  print(f"\ntiny fp8: {want} bytes/token/layer vs fp32 {(c + r + d) * 4}")


def test_671b_cache_sizes():
  # 512 + 64 + 128 = 704 numbers per token per layer; fp8: 512 + 16 + 128 + 128 + 4 (FlashMLA's 656 + 132)
  cfg = make_config(model_name="deepseek3.2-671b", kv_cache_dtype="bfloat16")
  assert kv_cache.bytes_per_token_per_layer(cfg) == 704 * 2
  cfg8 = make_config(model_name="deepseek3.2-671b", kv_cache_dtype="fp8")
  assert kv_cache.bytes_per_token_per_layer(cfg8) == 788
  print(f"\n671B per token per layer: bf16 1408 B, fp8 788 B (incl. scales); "
        f"an expanded per-head K/V cache would be {128 * (192 + 128) * 2} B")


def test_without_the_indexer_there_is_no_indexer_cache():
  cfg = _cfg(use_indexer=False)
  assert paged_pools.init_pools(cfg, 1, 8)["moe_layers"].idx_k is None
  assert kv_cache.init_layer_cache(cfg, 1).idx_k is None
  assert kv_cache.bytes_per_token_per_layer(cfg) == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_layouts_follow_scan_layers():
  stacked = paged_pools.init_pools(_cfg(scan_layers=True), 4, 8)
  assert stacked["moe_layers"].c_kv.shape == (3, 32, 32)  # [L,N,kv_lora], N = 4 pages x 8
  assert stacked["dense_layers"].idx_k.shape == (1, 32, 16)  # [L,N,d]
  per_layer = paged_pools.init_pools(_cfg(scan_layers=False), 4, 8)
  assert isinstance(per_layer["moe_layers"], list) and len(per_layer["moe_layers"]) == 3
  assert per_layer["moe_layers"][0].k_pe.shape == (32, 8)
  contiguous = kv_cache.init_layer_cache(_cfg(), 2, num_layers=3)
  assert contiguous.c_kv.shape == (3, 2, 32, 32)  # [L,b,S,kv_lora]
  assert contiguous.idx_k.shape == (3, 2, 16, 32)  # [L,b,d,S]: transposed for the score matmul


# ---------------------------------------------------------------- fp8 blocks


def test_fp8_round_trip_error_is_within_e4m3_precision_per_block():
  rng = np.random.default_rng(0)
  # 300 = 2 full blocks + a partial one; block magnitudes far apart: each block keeps its own scale
  x = rng.standard_normal((4, 300)).astype(np.float32) * np.repeat([1e-3, 1.0, 50.0], [128, 128, 44])
  q, scale = kv_cache.quantize_fp8(jnp.asarray(x))
  assert q.dtype == jnp.float8_e4m3fn and q.shape == (4, 300) and scale.shape == (4, 3)
  y = np.asarray(kv_cache.dequantize_fp8(q, scale))
  for lo, hi in ((0, 128), (128, 256), (256, 300)):
    blk, err = x[:, lo:hi], np.abs(y[:, lo:hi] - x[:, lo:hi])
    amax = np.abs(blk).max(-1, keepdims=True)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normal values; subnormals
    # (below 2^-6 of the block's scaled range) have an absolute step of 2^-9 * scale
    assert np.all(err <= np.maximum(np.abs(blk) * 2 ** -4, amax / 448 * 2 ** -9) * 1.0001)
  np.testing.assert_allclose(np.asarray(scale[:, 2]), np.abs(x[:, 256:]).max(-1) / 448, rtol=1e-6)


def test_fp8_of_zeros_and_of_the_block_maximum_is_exact():
  q, scale = kv_cache.quantize_fp8(jnp.zeros((2, 16)))
  assert np.all(np.asarray(kv_cache.dequantize_fp8(q, scale)) == 0)  # no 0/0
  x = jnp.asarray([[-3.0, 1.5, 0.0, 3.0]])
  y = kv_cache.dequantize_fp8(*kv_cache.quantize_fp8(x))
  assert float(y[0, 0]) == -3.0 and float(y[0, 3]) == 3.0  # amax maps to 448 exactly: no NaN overflow


def test_each_of_the_256_fp8_codes_decodes_to_its_e4m3_value_as_the_kernels_decode_it():
  # kv_cache.e4m3_values (XLA's convert: the XLA paths) and paged_decode.e4m3_to_f32 (integer ops: the Pallas
  # kernels) give every code ml_dtypes' value (the release's torch float8_e4m3fn), bit for bit with the sign
  # of -0.0 (0x80); the two NaN codes (0x7F, 0xFF: e4m3fn has no infinity) decode to NaN in both
  codes = np.arange(256, dtype=np.uint8)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  assert np.isnan(want).sum() == 2
  ok = ~np.isnan(want)
  scale = jnp.asarray([[0.5, 2.0]], jnp.float32)  # two 128-blocks: each code once per block
  kernels = np.asarray(jax.jit(e4m3_to_f32)(jnp.asarray(codes)))
  for q in (jnp.asarray(codes), jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)):
    xla = np.asarray(jax.jit(kv_cache.e4m3_values)(q))
    for got in (xla, kernels):
      assert got.dtype == np.float32
      np.testing.assert_array_equal(np.isnan(got), ~ok)
      np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # subnormals, +-448, -0.0
    deq = np.asarray(jax.jit(kv_cache.dequantize_fp8)(q[None], scale))[0]  # [256]
    np.testing.assert_array_equal(deq, xla * np.repeat([0.5, 2.0], 128).astype(np.float32))


# ---------------------------------------------------------------- write and read


def _entries(cfg, b, t, seed, lead=()):
  rng = np.random.default_rng(seed)
  f = lambda n: jnp.asarray(rng.standard_normal(lead + (b, t, n)), jnp.float32)
  return f(cfg.kv_lora_rank), f(cfg.qk_rope_head_dim), f(cfg.indexer_head_dim)


def test_ragged_write_into_a_stacked_cache_touches_only_each_rows_window():
  cfg = _cfg()
  cache = kv_cache.init_layer_cache(cfg, 2, num_layers=3)  # [L,b,S,n], S=32
  c, r, d = _entries(cfg, 2, 4, 0, lead=(3,))  # [L,b,t,n]: every layer at once
  start = jnp.asarray([5, 28])  # each row its own position; row 1's window ends at the last slot
  new = jax.jit(lambda cache, start, c, r, d: kv_cache.write(cache, start, c_kv=c, k_pe=r, idx_k=d))(
      cache, start, c, r, d)
  got = np.asarray(new.c_kv)
  np.testing.assert_array_equal(got[:, 0, 5:9], np.asarray(c[:, 0]))
  np.testing.assert_array_equal(got[:, 1, 28:32], np.asarray(c[:, 1]))
  np.testing.assert_array_equal(np.asarray(new.k_pe)[2, 1, 28:32], np.asarray(r[2, 1]))
  np.testing.assert_array_equal(np.asarray(new.idx_k)[1, 0, :, 5:9], np.asarray(d[1, 0]).T)  # stored [d,S]
  mask = np.zeros(got.shape[:3], bool)
  mask[:, 0, 5:9] = mask[:, 1, 28:32] = True
  assert np.all(got[~mask] == 0)  # other rows' slots untouched
  view = jax.tree.map(lambda a: a[1], new)  # layer 1 as [b,S,..]
  c_all, r_all = kv_cache.read_latents(view)
  np.testing.assert_array_equal(np.asarray(r_all)[0, 5:9], np.asarray(r[1, 0]))
  assert c_all.shape == (2, 32, cfg.kv_lora_rank)
  keys = np.asarray(kv_cache.read_indexer_keys(view))  # read back as [b,S,d]
  np.testing.assert_array_equal(keys[1, 28:32], np.asarray(d[1, 1]))
  assert np.all(keys[1, :28] == 0)


def test_write_is_in_place_under_jit_with_a_donated_cache():
  # A copy of the cache per step would make every decode step O(S) in memory traffic.
  cfg = _cfg(max_target_length=4096, max_prefill_length=16)
  cache = kv_cache.init_layer_cache(cfg, 2, num_layers=3)
  c, r, d = _entries(cfg, 2, 1, 0, lead=(3,))
  f = jax.jit(lambda cache, start, c, r, d: kv_cache.write(cache, start, c_kv=c, k_pe=r, idx_k=d), donate_argnums=0)
  hlo = f.lower(cache, jnp.asarray([7, 4095]), c, r, d).compile().as_text()
  big = [l for l in hlo.split("\n") if " copy(" in l and "4096" in l]
  assert not big, big


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_as_stored_is_what_a_write_then_read_returns(dtype):
  cfg = _cfg(kv_cache_dtype=dtype)
  cache = kv_cache.init_layer_cache(cfg, 2)
  c, r, d = _entries(cfg, 2, 32, 3)
  cache = kv_cache.write(cache, jnp.zeros((2,), jnp.int32), c_kv=c, k_pe=r, idx_k=d)
  c_all, r_all = kv_cache.read_latents(cache)
  np.testing.assert_array_equal(np.asarray(kv_cache.as_stored(cache, "c_kv", c)), np.asarray(c_all))
  np.testing.assert_array_equal(np.asarray(kv_cache.as_stored(cache, "k_pe", r)), np.asarray(r_all))
  np.testing.assert_array_equal(np.asarray(kv_cache.as_stored(cache, "idx_k", d)),
                                np.asarray(kv_cache.read_indexer_keys(cache)))


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_gather_latents_reads_the_selected_rows(dtype):
  cfg = _cfg(kv_cache_dtype=dtype)
  cache = kv_cache.init_layer_cache(cfg, 2)
  c, r, d = _entries(cfg, 2, 32, 1)
  cache = kv_cache.write(cache, jnp.zeros((2,), jnp.int32), c_kv=c, k_pe=r, idx_k=d)
  idx = jnp.asarray([[3, 0, 31], [7, 7, 2]], jnp.int32)
  cs, rs = kv_cache.gather_latents(cache, idx)
  c_all, r_all = kv_cache.read_latents(cache)
  np.testing.assert_array_equal(np.asarray(cs), np.take_along_axis(np.asarray(c_all), np.asarray(idx)[..., None], 1))
  np.testing.assert_array_equal(np.asarray(rs), np.take_along_axis(np.asarray(r_all), np.asarray(idx)[..., None], 1))
  tol = 0.07 if dtype == "fp8" else 0  # e4m3 rounding of c_kv; k_pe is bf16 under fp8
  np.testing.assert_allclose(np.asarray(c_all), np.asarray(c), rtol=tol, atol=tol * 0.05)
  keys = kv_cache.read_indexer_keys(cache)
  np.testing.assert_allclose(np.asarray(keys), np.asarray(d), rtol=tol, atol=tol * 0.05)


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_indexer_queries_are_rounded_to_fp8_in_one_place_for_every_scoring_path(dtype):
  """CacheView.select_indexer(fp8_queries=True) with an fp8 indexer cache scores e4m3 queries (per-128-block
  scales: paged_decode.fp8_scored_queries) on the contiguous cache, the paged XLA loop and the Pallas kernel
  alike; an fp32 cache keeps fp32 queries."""
  from MaxText.inference.cache_view import CacheView
  from MaxText.kernels import backend
  from MaxText.kernels.paged_decode import fp8_scored_queries
  cfg = _cfg(kv_cache_dtype=dtype)
  b, s, page, h, d = 2, 32, 8, 4, cfg.indexer_head_dim
  c, r, keys = _entries(cfg, b, s, 5)
  contiguous = kv_cache.write(kv_cache.init_layer_cache(cfg, b), jnp.zeros((b,), jnp.int32), c_kv=c, k_pe=r,
                              idx_k=keys)
  table = jnp.asarray(np.random.default_rng(2).permutation(b * s // page).reshape(b, s // page), jnp.int32)
  pools = paged_pools.init_layer_pools(cfg, b * s)
  pools = paged_pools.write(pools, paged_pools.slots(table, jnp.tile(jnp.arange(s), (b, 1)), page, b * s),
                            c_kv=c, k_pe=r, idx_k=keys)
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
  w = jnp.asarray(rng.uniform(size=(b, 1, h)), jnp.float32)
  pos = jnp.asarray([[20], [31]], jnp.int32)
  k_new = kv_cache.as_stored(contiguous, "idx_k", keys[:, 20:21])  # [b,1,d]

  def scores(view, q, w, fp8_queries):
    return jax.jit(lambda q, w: view.select_indexer(q, w, k_new, pos, lambda x: (x,), max_bytes=1 << 20,
                                                    fp8_queries=fp8_queries)[0])(q, w)  # [b,1,S+1]

  flat, paged = CacheView(contiguous, None), CacheView(pools, None, table, page)
  got, f32 = scores(flat, q, w, True), scores(flat, q, w, False)
  if dtype == "float32":
    np.testing.assert_array_equal(got, f32)
    return
  with backend.forced(paged_scoring="pallas"):
    kernel = scores(paged, q, w, True)
  fin = np.isfinite(np.asarray(got))
  for other in (scores(paged, q, w, True), kernel):
    np.testing.assert_array_equal(np.isfinite(np.asarray(other)), fin)
    np.testing.assert_allclose(np.asarray(other)[fin], np.asarray(got)[fin], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got, scores(flat, *fp8_scored_queries(q, w), False))
  assert np.max(np.abs(np.asarray(got - f32)[fin])) > 1e-4  # the queries' rounding shows in the scores


@pytest.mark.parametrize("unpack", ["bitcast", "shifts"])  # backend.py's fp8_unpack: the cpu's, the tpu's
@pytest.mark.parametrize("n", [512, 8])  # the latent (a word piece = one 128-block), a row narrower than a block
def test_words_hold_codes_in_the_backends_order_and_dequantize_to_the_codes_values(n, unpack):
  # to_words under fp8_unpack "shifts": word i of a row holds codes i, w+i, 2w+i, 3w+i (byte j, least significant
  # first: code j*w + i, w = n/4), so the 512-wide latent's piece j is its 128-block j, dequantized from its byte;
  # under "bitcast": codes 4i .. 4i+3. Either way from_words gives the codes back and the pool's words dequantize
  # to what the codes do.
  from MaxText.kernels.fp8_blocks import from_words, to_words
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((3, n)) * np.exp2(rng.uniform(-8, 8, (3, 1))), jnp.float32)
  codes, scale = kv_cache.quantize_fp8(x)  # [3,n] e4m3, [3, ceil(n/128)]
  bits = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8))
  w = n // 4
  with backend.forced(fp8_unpack=unpack):
    words = np.asarray(to_words(codes))  # [3, n/4] uint32
    for j in range(4):
      want = bits[:, j * w:(j + 1) * w] if unpack == "shifts" else bits[:, j::4]
      np.testing.assert_array_equal((words >> (8 * j)) & 0xFF, want)
    np.testing.assert_array_equal(np.asarray(from_words(jnp.asarray(words))), bits)
    want = np.asarray(kv_cache.dequantize_fp8(codes, scale))
    got = np.asarray(kv_cache.dequantize_fp8(jnp.asarray(words), scale))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(want, np.asarray(x), rtol=2 ** -3)  # e4m3: 3 mantissa bits


def test_pairs_hold_bf16_values_strided_so_unpacking_is_two_whole_pieces():
  # to_pairs: word i of a row of n bf16 values holds values i (low half) and n/2 + i (high half): from_pairs is a mask,
  # a shift and a concatenation of two [..., n/2] pieces (a k_pe slot's 64 values: 32 words).
  from MaxText.kernels.fp8_blocks import from_pairs, to_pairs
  rng = np.random.default_rng(12)
  bits = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16), jnp.uint16)
  words = np.asarray(jax.lax.bitcast_convert_type(to_pairs(bits), jnp.uint32))  # [3, 32]
  np.testing.assert_array_equal(words & 0xFFFF, np.asarray(bits)[:, :32])
  np.testing.assert_array_equal(words >> 16, np.asarray(bits)[:, 32:])
  np.testing.assert_array_equal(np.asarray(from_pairs(to_pairs(bits))), np.asarray(bits))
