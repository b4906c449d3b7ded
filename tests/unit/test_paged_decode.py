"""The Pallas decode kernels (kernels/paged_decode.py) against their XLA references (interpreted off a TPU,
compiled by Mosaic on one: `pytest -m device` there), lowered to Mosaic for a TPU on any host, and the paged key
source taking the scoring kernel where backend.py's table says so."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText.inference import kv_cache, paged_cache
from MaxText.inference.paged_cache import PagedKeys
from MaxText.kernels import backend
from MaxText.kernels import paged_decode as pd
from MaxText.kernels.fp8_blocks import to_pairs
from tests.support.kernels import assert_every_dma_waited, bits, close, dma_eager_interpreter, mla_case

pytestmark = pytest.mark.device  # runs unchanged on a TPU: the kernels compiled by Mosaic there

B, PAGE, P = 2, 8, 4  # 2 rows of 4 pages of 8 slots; the pool holds exactly their pages
N = B * P * PAGE


def test_bit_decoding_is_exact_for_every_fp8_code_and_bf16_values():
  codes = np.arange(256, dtype=np.uint8)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(pd.e4m3_to_f32(jnp.asarray(codes)))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])  # subnormals, signs, 448 alike
  x = jax.random.normal(jax.random.key(0), (64,)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(pd._bf16_bits_to_f32(bits(x, jnp.bfloat16)), x.astype(jnp.float32))


def _scoring(page: int) -> dict:
  """B rows of P pages of `page` slots, the pool exactly their pages in a shuffled table."""
  k = jax.random.split(jax.random.key(1), 4)
  table = jnp.asarray(np.random.default_rng(0).permutation(B * P).reshape(B, P), jnp.int32)
  return dict(q=jax.random.normal(k[0], (B, 4, 128)), w=jax.random.uniform(k[1], (B, 4)),
              keys=jax.random.normal(k[2], (B * P * page, 128)), table=table, pos=jnp.array([P * page - 1, 13]))


@pytest.fixture(scope="module")
def scoring_case():
  return _scoring(PAGE)


@pytest.fixture(scope="module")
def scoring_case_64():
  return _scoring(64)  # 2 pages a block are 128 slots: the smallest block Mosaic tiles (backend.mosaic_block)


@pytest.mark.parametrize("dtype", ["float32", "fp8_keys", "fp8_keys_and_queries"])
def test_paged_index_scores_equal_the_xla_path(scoring_case, dtype):
  c = scoring_case
  q, q_scale, keys, k_scale = c["q"], None, c["keys"], None
  if dtype != "float32":
    kq, k_scale = kv_cache.quantize_fp8(keys)
    keys = bits(kq, jnp.float8_e4m3fn)
    empty = int(c["table"][1, 3]) * PAGE  # a page past row 1's position with zero scales (as a fresh pool's):
    k_scale = k_scale.at[empty:empty + PAGE].set(0.0)  # its slots stay -inf, never 0 x -inf = NaN
  if dtype == "fp8_keys_and_queries":
    q, q_scale = pd.fp8_queries(q)
  args = (q, q_scale, c["w"], keys, k_scale, c["table"], c["pos"], PAGE)
  got = pd.paged_index_scores(*args, pages_per_block=2)
  ref = pd.paged_index_scores_xla(*args)
  assert np.isinf(np.asarray(got)[1, 14:]).all() and np.isfinite(np.asarray(got)[1, :14]).all()  # past pos: -inf
  close(got, ref, 1e-5)  # fp32 rounding: the same dequantized values on both sides


def test_the_fp8_keys_scales_are_gathered_a_page_row_a_table_entry_not_a_slot_at_a_time(scoring_case):
  """The scales join the kernel's scores after it, gathered from the pool by the table: a page row of `page`
  scales per table entry (B x P gathers). Gathered one scale a slot (B x P x page one-element gathers, 7e43b6b),
  the v5e's 16-row 128K fp8 decode step took 17.94 ms against 3.29 (docs/kernels.md), though XLA's cost
  estimate had priced it cheaper: every gather here moves whole page rows."""
  from tests.support.kernels import jaxpr_eqns
  c = scoring_case
  kq, k_scale = kv_cache.quantize_fp8(c["keys"])
  args = (c["q"], None, c["w"], bits(kq, jnp.float8_e4m3fn), k_scale, c["table"], c["pos"])
  jaxpr = jax.make_jaxpr(lambda *a: pd.paged_index_scores(*a, PAGE, pages_per_block=2))(*args).jaxpr
  gathers = [e for e, _ in jaxpr_eqns(jaxpr) if e.primitive.name == "gather"]
  assert gathers, "no gather traced: the check would pass vacuously"
  for e in gathers:
    assert int(np.prod(e.params["slice_sizes"])) >= PAGE, e.params["slice_sizes"]


@pytest.mark.parametrize("pos", [(-1, 13), (0, 128), (127, 255), (300, 13)])  # a padding row; block edges (2 pages
# of 64 = 128 slots); a position past the table's 256 slots: every slot scored (the kernel clamps its last block to
# the table's)
def test_the_kernel_reads_only_the_blocks_up_to_each_rows_position(scoring_case_64, pos, monkeypatch):
  """Blocks past a row's position are not read (no DMA started, every score -inf): the scores equal the XLA
  path's for rows ending at a block's first or last slot, or before any (pos -1: all -inf)."""
  c, page = scoring_case_64, 64
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  args = (c["q"], None, c["w"], bits(kq, jnp.float8_e4m3fn), ks, c["table"], jnp.asarray(pos, jnp.int32), page)
  got = np.asarray(pd.paged_index_scores(*args, pages_per_block=2))
  ref = np.asarray(pd.paged_index_scores_xla(*args))
  for r, p in enumerate(pos):
    assert np.isinf(got[r, p + 1:]).all() and np.isfinite(got[r, :p + 1]).all()
  if max(pos) >= 0:
    close(got, ref, 1e-5)
  # PagedKeys' XLA loop (the CPU's) skips the same blocks: blocks of 2 pages there too
  monkeypatch.setattr(paged_cache, "KEY_BLOCK_BYTES", 2 * page * 128 * 4)
  src = PagedKeys(args[3], args[4], c["table"], page)
  xla = np.asarray(src.scores(c["q"][:, None], c["w"][:, None] * 128 ** 0.5, args[6][:, None], head_chunk=4))[:, 0]
  # (PagedKeys takes the weights before index_weights' d**-0.5: the kernel's w is this test's as given)
  np.testing.assert_array_equal(np.isfinite(xla), np.isfinite(got))
  if max(pos) >= 0:
    close(xla, ref, 1e-5)


@pytest.mark.parametrize("pos", [(-1, 13), (0, 128), (127, 255), (300, 13)])
def test_the_kernels_dma_pipeline_waits_for_every_copy_it_starts(scoring_case_64, pos, capfd):
  """Block j+1's copies start only where the row needs block j+1 (j < needed), and each one started is waited for:
  under the TPU interpreter with DMAs executed as they start, no semaphore still counts at the kernel's exit (a start
  at j <= needed, one block past the last needed, leaves one: on a TPU a read of pages the row does not own)."""
  c, page = scoring_case_64, 64
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  args = (c["q"], None, c["w"], bits(kq, jnp.float8_e4m3fn), ks, c["table"], jnp.asarray(pos, jnp.int32), page)
  got = pd.paged_index_scores(*args, pages_per_block=2, interpret=dma_eager_interpreter())
  assert_every_dma_waited(capfd)
  if max(pos) >= 0:
    close(got, pd.paged_index_scores_xla(*args), 1e-5)


@pytest.mark.parametrize("n,want,block,padded", [
    (32, 16, 32, 32),      # 16 lanes: the smallest tileable multiple (128) covers the axis: one block, whole
    (128, 16, 128, 128),   # ... exactly
    (256, 16, 128, 256),   # two blocks of 8 x 16
    (200, 16, 128, 256),   # padded to whole blocks
    (256, 48, 256, 256),   # lcm(48, 128) = 384 >= 256: one block, the whole axis
    (1024, 48, 384, 1152),  # 384 = 8 x 48 slots, 3 blocks
    (512, 256, 256, 512),  # tileable as asked
    (300, 256, 256, 512),  # tileable as asked, padded
    (100, 128, 128, 128),  # one block, padded
])
def test_mosaic_block_is_a_multiple_of_128_lanes_of_whole_units_or_the_whole_axis(n, want, block, padded):
  assert backend.mosaic_block(n, want) == (block, padded)
  got, total = backend.mosaic_block(n, want)
  assert got % want == 0 or got == n
  assert total % got == 0 and total >= n and (got % 128 == 0 or got == total == n)


def test_every_kernel_shape_of_these_tests_lowers_to_mosaic():
  """The blocks the kernels are asked for here (2 pages of 8 slots, 16 selected slots) are not tileable by
  Mosaic: each kernel pads or widens them (backend.mosaic_block) and lowers for a TPU (jax.export on the CPU),
  where it raised "the last two dimensions of your block shape are divisible by 8 and 128"."""
  from jax import export
  s = jax.ShapeDtypeStruct
  for dtype, scale in ((jnp.float32, None), (jnp.uint8, s((N, 1), jnp.float32))):
    args = (s((B, 4, 128), jnp.float32), s((B, 4), jnp.float32), s((N, 128), dtype), scale, s((B, P), jnp.int32),
            s((B,), jnp.int32))
    fn = jax.jit(lambda q, w, k, ks, t, pos: pd.paged_index_scores(q, None, w, k, ks, t, pos, PAGE, pages_per_block=2,
                                                                   interpret=False))
    assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(*args).mlir_module()
  for fp8 in (False, True):
    args = (s((B, 4, 128), jnp.float32), s((B, 4, 64), jnp.float32), s((B, 32), jnp.int32), s((B, 32), jnp.bool_),
            s((N, 128), jnp.uint8 if fp8 else jnp.float32), s((N, 64), jnp.float32),
            s((N, 1), jnp.float32) if fp8 else None)
    fn = jax.jit(lambda *a: pd.sparse_mla_decode(*a, 0.1, block=16, interpret=False))
    assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(*args).mlir_module()


def test_fp8_queries_stay_within_their_rounding_of_f32_scores(scoring_case):
  """fp8 queries and keys (e4m3: 3 mantissa bits, relative step 2**-4) against f32 scoring of the
  same keys: the stated tolerance is 10% of the largest score."""
  c = scoring_case
  q8, qs = pd.fp8_queries(c["q"])
  exact = pd.paged_index_scores_xla(c["q"], None, c["w"], c["keys"], None, c["table"], c["pos"], PAGE)
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  fp8 = pd.paged_index_scores(q8, qs, c["w"], bits(kq, jnp.float8_e4m3fn), ks, c["table"], c["pos"], PAGE,
                              pages_per_block=4)
  close(fp8, exact, 0.1)


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_decode_equals_the_xla_path(fp8):
  r = 64
  q_abs, q_pe, ids, valid, c_kv, k_pe, scale = mla_case(fp8, rows=B, slots=N, heads=4, selected=32, r=r)
  got = pd.sparse_mla_decode(q_abs, q_pe, ids, valid, c_kv, k_pe, scale, 0.1, block=16)
  ref = pd.sparse_mla_decode_xla(q_abs, q_pe, ids, valid, c_kv, k_pe, scale, 0.1)
  close(got, ref, 1e-5)
  if fp8:  # k_pe as paged_cache's tpu row holds it: int32 pairs, 4 slots a 128-word row
    rows = to_pairs(k_pe).reshape(N // 4, 4 * r // 2)  # [N/4, 128]
    np.testing.assert_array_equal(pd.sparse_mla_decode(q_abs, q_pe, ids, valid, c_kv, rows, scale, 0.1, block=16,
                                                       ), got)
    np.testing.assert_array_equal(pd.sparse_mla_decode_xla(q_abs, q_pe, ids, valid, c_kv, rows, scale, 0.1), ref)
  assert np.all(np.asarray(got)[1] == 0)
  assert np.max(np.abs(np.asarray(got)[0])) > 0.1


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_keys_take_the_kernel_under_the_pallas_row_and_score_alike(scoring_case, fp8, monkeypatch):
  c = scoring_case
  keys, scale = c["keys"], None
  if fp8:
    kq, scale = kv_cache.quantize_fp8(keys)
    keys = bits(kq, jnp.float8_e4m3fn)
  src = PagedKeys(keys, scale, c["table"].at[1, 3].set(-1), PAGE)  # a missing page: past pos, -inf either way
  q, w, pos = c["q"][:, None], c["w"][:, None], c["pos"][:, None]
  xla = jax.jit(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos)
  with backend.forced(paged_scoring="pallas"):
    kernel = jax.jit(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos)
  close(kernel, xla, 1e-5)
  for slots in (PAGE - 1, PAGE, 3 * PAGE):  # a block of fewer slots than a page is one page; 3 pages pad P to 6
    monkeypatch.setattr(paged_cache, "SCORE_BLOCK_SLOTS", slots)
    with backend.forced(paged_scoring="pallas"):
      close(jax.jit(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos), xla, 1e-5)
  with pytest.raises(ValueError, match="paged_scoring"):
    with backend.forced(paged_scoring="mosaic"):
      pass



def test_fp8_scored_queries_are_the_releases_fp8_queries_with_their_scales_in_the_weights(scoring_case):
  """fp8_scored_queries (what every decode scoring path takes with an fp8 indexer cache) scores as the
  release's e4m3 codes with per-128-block scales (fp8_queries): the codes' values exact in bf16, the
  scales in the head weights; wider heads get the dequantized queries."""
  c = scoring_case
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  keys = bits(kq, jnp.float8_e4m3fn)
  q8, qs = pd.fp8_queries(c["q"])
  qv, wv = pd.fp8_scored_queries(c["q"], c["w"])
  assert qv.dtype == jnp.bfloat16
  np.testing.assert_array_equal(qv.astype(jnp.float32), pd.as_values(q8))  # the codes' values, exactly
  np.testing.assert_array_equal(wv, c["w"] * qs)
  release = pd.paged_index_scores_xla(q8, qs, c["w"], keys, ks, c["table"], c["pos"], PAGE)
  close(pd.paged_index_scores_xla(qv, None, wv, keys, ks, c["table"], c["pos"], PAGE), release, 1e-6)
  f32 = pd.paged_index_scores_xla(c["q"], None, c["w"], keys, ks, c["table"], c["pos"], PAGE)
  assert np.max(np.abs(np.asarray(f32 - release)[np.isfinite(release)])) > 1e-4  # the rounding shows
  wide = jnp.concatenate([c["q"], 3 * c["q"]], axis=-1)  # d 256: two blocks a head, two scales
  qw, ww = pd.fp8_scored_queries(wide, c["w"])
  np.testing.assert_array_equal(ww, c["w"])
  np.testing.assert_allclose(qw[..., 128:], 3 * qw[..., :128], rtol=1e-6)  # each block its own scale
  np.testing.assert_allclose(qw, wide, rtol=2 ** -4)


def test_the_kernel_scores_bf16_queries_in_one_mxu_pass(scoring_case):
  """fp8 keys: bf16 queries (fp8_scored_queries' e4m3 values) go in one dot of [H, d] rows, f32 queries in
  three bf16 parts ([3H, d]); the scores equal the XLA path's either way."""
  c = scoring_case
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  keys = bits(kq, jnp.float8_e4m3fn)
  qv, wv = pd.fp8_scored_queries(c["q"], c["w"])
  h = qv.shape[1]

  def stacked(q):  # does the kernel stack three bf16 parts [3H, d] for its dot?
    jaxpr = str(jax.make_jaxpr(lambda q: pd.paged_index_scores(q, None, wv, keys, ks, c["table"], c["pos"], PAGE,
                                                                pages_per_block=2))(q))
    assert f"bf16[{h},128]" in jaxpr
    return f"bf16[{3 * h},128]" in jaxpr

  assert not stacked(qv)
  assert stacked(qv.astype(jnp.float32))
  args = (wv, keys, ks, c["table"], c["pos"], PAGE)
  close(pd.paged_index_scores(qv, None, *args, pages_per_block=2),
         pd.paged_index_scores_xla(qv, None, *args), 1e-5)


@pytest.mark.parametrize("pool, page", [(jnp.uint8, 64), (jnp.int8, 256)])  # natural; paired (test_paired_keys.py)
def test_the_kernel_lowers_to_mosaic_with_bf16_queries_against_fp8_keys(pool, page):
  """The one-pass path compiles for a TPU (Mosaic lowering on the CPU: jax.export), at the official head shape,
  over a natural pool and a paired one."""
  from jax import export
  b, h, d, p = 2, 64, 128, 16
  args = (jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, h), jnp.float32),
          jax.ShapeDtypeStruct((p * b * page, d), pool), jax.ShapeDtypeStruct((p * b * page, 1), jnp.float32),
          jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
  fn = jax.jit(lambda q, w, k, ks, t, pos: pd.paged_index_scores(q, None, w, k, ks, t, pos, page, pages_per_block=8,
                                                                 interpret=False))
  assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(*args).mlir_module()
