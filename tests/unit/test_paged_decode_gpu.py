"""The Triton (GPU) decode kernels (kernels/paged_decode_gpu.py) against the XLA references of paged_decode.py (in
Pallas' interpreter off a GPU; compiled by Triton on one: benchmarks/gpu_decode_check.sh tests), lowered for CUDA
(Triton IR, no GPU needed), and the paged key source taking the scoring kernel under paged_scoring "triton"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from MaxText.inference import kv_cache, paged_cache, paged_pools
from MaxText.inference.paged_cache import PagedKeys
from MaxText.kernels import backend
from MaxText.kernels import paged_decode as pd
from MaxText.kernels import paged_decode_gpu as pg
from MaxText.kernels.fp8_blocks import PAIRED_DTYPE, to_words
from tests.support.kernels import bits, close, mla_case

pytestmark = pytest.mark.device  # runs unchanged on one GPU (the kernels compiled there)


@pytest.fixture(autouse=True)
def _triton_runs_here():
  """Triton's kernels run on a GPU, or in Pallas' interpreter on the CPU (CI); a TPU has neither (interpreted
  there, the dots take the TPU's bf16 passes: not the kernels' arithmetic)."""
  if jax.default_backend() not in ("cpu", "gpu"):
    pytest.skip(f"Triton kernels: a GPU or the CPU's interpreter, not {jax.default_backend()}")

B, PAGE, P, H = 2, 16, 4, 16  # 2 rows of 4 pages of 16 slots, 16 heads (Triton: blocks powers of 2 >= 16)
N = B * P * PAGE


@pytest.fixture(scope="module")
def case():
  k = jax.random.split(jax.random.key(1), 4)
  table = jnp.asarray(np.random.default_rng(0).permutation(B * P).reshape(B, P), jnp.int32)
  return dict(q=jax.random.normal(k[0], (B, H, 128)), w=jax.random.uniform(k[1], (B, H)),
              keys=jax.random.normal(k[2], (N, 128)), table=table, pos=jnp.array([P * PAGE - 1, 21]))


def _fp8_keys(c):
  kq, ks = kv_cache.quantize_fp8(c["keys"])
  empty = int(c["table"][1, 3]) * PAGE  # a page past row 1's position with zero scales (a fresh pool's):
  return bits(kq, jnp.float8_e4m3fn), ks.at[empty:empty + PAGE].set(0.0)  # its slots stay -inf, not 0 x -inf


@pytest.mark.parametrize("queries", ["float32", "fp8_keys_f32_queries", "fp8_keys_bf16_queries", "fp8_keys_and_queries"])
@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_paged_index_scores_equal_the_xla_path(case, queries, pages_per_block):
  c = case
  q, q_scale, w, keys, k_scale = c["q"], None, c["w"], c["keys"], None
  if queries != "float32":
    keys, k_scale = _fp8_keys(c)
  if queries == "fp8_keys_bf16_queries":  # the engine's with indexer_fp8_queries: e4m3 values, scales in w
    q, w = pd.fp8_scored_queries(q, w)
  if queries == "fp8_keys_and_queries":
    q, q_scale = pd.fp8_queries(q)
  args = (q, q_scale, w, keys, k_scale, c["table"], c["pos"], PAGE)
  got = pg.paged_index_scores(*args, pages_per_block=pages_per_block)
  assert np.isinf(np.asarray(got)[1, 22:]).all() and np.isfinite(np.asarray(got)[1, :22]).all()  # past pos: -inf
  close(got, pd.paged_index_scores_xla(*args), 1e-5)  # fp32 rounding: the same values on both sides


@pytest.mark.parametrize("queries", ["f32", "bf16", "fp8"])
def test_the_hardwares_fp8_conversion_scores_alike(case, queries):
  """native_fp8 (sm89+: the keys converted by Triton's fp8 cast; with e4m3 queries an fp8 x fp8 dot) gives the
  integer decoding's scores bit for bit (every e4m3 value and product is exact either way); the MLA kernel too."""
  c = case
  keys, ks = _fp8_keys(c)
  q, q_scale, w = c["q"], None, c["w"]
  if queries == "bf16":
    q, w = pd.fp8_scored_queries(q, w)
  if queries == "fp8":
    q, q_scale = pd.fp8_queries(q)
  args = (q, q_scale, w, keys, ks, c["table"], c["pos"], PAGE)
  np.testing.assert_array_equal(pg.paged_index_scores(*args, native_fp8=True), pg.paged_index_scores(*args))
  mla = _mla_case(True)
  np.testing.assert_array_equal(pg.sparse_mla_decode(*mla, 0.1, block=16, heads_per_program=16, native_fp8=True),
                                pg.sparse_mla_decode(*mla, 0.1, block=16, heads_per_program=16))


@pytest.mark.parametrize("pos", [(-1, 15), (0, 16), (31, 32), (70, 13)])  # a padding row; block edges (2 pages =
# 32 slots); a position past the table's 64 slots: every slot scored
def test_the_scores_end_at_each_rows_position(case, pos):
  c = case
  keys, ks = _fp8_keys(c)
  args = (c["q"], None, c["w"], keys, ks.at[:].set(jnp.abs(ks) + 1e-3), c["table"], jnp.asarray(pos, jnp.int32),
          PAGE)
  got = np.asarray(pg.paged_index_scores(*args, pages_per_block=2))
  for r, p in enumerate(pos):
    assert np.isinf(got[r, p + 1:]).all() and np.isfinite(got[r, :p + 1]).all()
  if max(pos) >= 0:
    close(got, pd.paged_index_scores_xla(*args), 1e-5)


def _mla_case(fp8: bool, c: int = 256):
  return mla_case(fp8, rows=B, slots=N, heads=32, selected=64, c=c)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block, heads, splits", [(16, 16, 1), (32, 32, 1), (16, 32, 2), (16, 16, 4)])
def test_sparse_mla_decode_equals_the_xla_path(fp8, block, heads, splits):
  args = _mla_case(fp8)
  if splits > 1:  # row 0's first 16 slots invalid: with 4 splits one split is empty (its lse -inf, merged as 0)
    args = args[:3] + (args[3].at[0, :16].set(False),) + args[4:]
  got = pg.sparse_mla_decode(*args, 0.1, block=block, heads_per_program=heads, splits=splits)
  ref = pd.sparse_mla_decode_xla(*args, 0.1)
  close(got, ref, 1e-5)  # 3 bf16 parts against the fp8 codes: fp32-accurate
  assert np.all(np.asarray(got)[1] == 0)
  assert np.max(np.abs(np.asarray(got)[0])) > 0.1
  if fp8:  # the latent as the gpu row's pool holds it (uint32 words, 4 codes a word): the same result
    q_abs, q_pe, ids, valid, c_kv, k_pe, s = args
    words = pg.sparse_mla_decode(q_abs, q_pe, ids, valid, to_words(c_kv), k_pe, s, 0.1, block=block,
                                 heads_per_program=heads, splits=splits)
    np.testing.assert_array_equal(words, got)


def test_sparse_mla_decode_in_one_bf16_part_is_flashmlas_rounding():
  """parts=1: the fp32 query and scaled probabilities rounded to bf16 once (FlashMLA's arithmetic): within
  bf16's relative step of the fp32 result, and visibly not fp32-accurate (the parts do something)."""
  args = _mla_case(True)
  ref = np.asarray(pd.sparse_mla_decode_xla(*args, 0.1))
  err = np.max(np.abs(np.asarray(pg.sparse_mla_decode(*args, 0.1, block=16, heads_per_program=16, parts=1)) - ref)) / np.max(np.abs(ref))
  assert 1e-5 < err < 2 ** -7, err


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_keys_take_the_triton_kernel_when_forced_and_score_alike(case, fp8):
  c = case
  keys, scale = (c["keys"], None) if not fp8 else _fp8_keys(c)
  src = PagedKeys(keys, scale, c["table"].at[1, 3].set(-1), PAGE)  # a missing page: past pos, -inf either way
  q, w, pos = c["q"][:, None], c["w"][:, None], c["pos"][:, None]
  xla = jax.jit(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos)
  with backend.forced(paged_scoring="triton"):
    jaxpr = str(jax.make_jaxpr(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos))
    kernel = jax.jit(lambda *a: src.scores(*a, head_chunk=2))(q, w, pos)
  assert "paged_index_scores_gpu" in jaxpr
  close(kernel, xla, 1e-5)


def test_the_triton_blocks_are_a_power_of_two_of_pages(case, monkeypatch):
  """PagedKeys' Triton route: the largest power of 2 of pages within GPU_SCORE_BLOCK_SLOTS (at least one), the
  table padded to whole blocks; any block size scores alike."""
  c = case
  src = PagedKeys(c["keys"], None, c["table"][:, :3], PAGE)  # 3 pages: padded to 4 at 2 or 4 pages a block
  q, w, pos = c["q"][:, None], c["w"][:, None], jnp.minimum(c["pos"], 47)[:, None]
  xla = src.scores(q, w, pos, head_chunk=2)
  seen, kernel = [], pg.paged_index_scores

  def spy(*args, pages_per_block):
    seen.append((pages_per_block, args[5].shape[1]))  # pages a block, the padded table's pages
    return kernel(*args, pages_per_block=pages_per_block)

  monkeypatch.setattr(pg, "paged_index_scores", spy)
  for slots, want in ((PAGE - 1, (1, 3)), (PAGE, (1, 3)), (3 * PAGE, (2, 4)), (4 * PAGE, (4, 4))):
    monkeypatch.setattr(paged_cache, "GPU_SCORE_BLOCK_SLOTS", slots)
    with backend.forced(paged_scoring="triton"):
      got = src.scores(q, w, pos, head_chunk=2)
    assert seen[-1] == want
    close(got, xla, 1e-5)


def test_shapes_triton_cannot_take_get_one_line():
  c = _mla_case(True)
  with pytest.raises(ValueError, match="powers of 2 of at least 16.*block=24"):
    pg.sparse_mla_decode(*_mla_case(True, 256)[:2], jnp.zeros((B, 48), jnp.int32), jnp.ones((B, 48), bool),
                         *c[4:], 0.1, block=24)
  with pytest.raises(ValueError, match="one slot a row"):
    pg.sparse_mla_decode(*c[:5], c[5].reshape(N // 2, -1), c[6], 0.1)
  q = jnp.zeros((B, H, 128))
  with pytest.raises(ValueError, match="paired"):
    pg.paged_index_scores(q, None, jnp.zeros((B, H)), jnp.zeros((N, 128), PAIRED_DTYPE), jnp.ones((N, 1)),
                          jnp.zeros((B, P), jnp.int32), jnp.zeros((B,), jnp.int32), PAGE)
  with pytest.raises(ValueError, match="keys_a_block=8"):
    pg.paged_index_scores(q, None, jnp.zeros((B, H)), jnp.zeros((N, 128)), None, jnp.zeros((B, P), jnp.int32),
                          jnp.zeros((B,), jnp.int32), 8, pages_per_block=1)


def _lowered_for_cuda(fn, *args) -> str:
  """fn's module lowered for CUDA on this host (no GPU: Pallas' Triton lowering runs in Python for an H200 named
  by an abstract device; the PTX compile is the GPU's)."""
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with backend.forced("gpu"), jax.sharding.use_abstract_mesh(h200):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fp8, native", [(False, False), (True, False), (True, True)])
def test_both_kernels_lower_to_triton_at_the_official_shapes(fp8, native):
  """The indexer's 64 heads of 128 over pages of 64 (fp8 keys, bf16 queries: the engine's), MLA's 128 heads of
  512 + 64 over 2048 selected slots (the pools as the gpu row holds them; fp8: with the lse, as the engine calls
  it; native: the fp8 conversions and the fp8 x fp8 dot, for an H200's sm90): both lower to a Triton call."""
  sds = jax.ShapeDtypeStruct
  b, n, page = 2, 4096, 64
  keys = (sds((n, 128), jnp.uint8), sds((n, 1), jnp.float32)) if fp8 else (sds((n, 128), jnp.float32), None)
  txt = _lowered_for_cuda(lambda q, w, t, pos, k, *ks: pg.paged_index_scores(q, None, w, k, *(ks or [None]), t, pos,
                                                                             page, native_fp8=native),
                          sds((b, 64, 128), jnp.bfloat16 if fp8 else jnp.float32), sds((b, 64), jnp.float32),
                          sds((b, n // page // b), jnp.int32), sds((b,), jnp.int32), *[k for k in keys if k])
  assert "xla.gpu.triton" in txt and "paged_index_scores_gpu" in txt
  pools = ((sds((n, 128), jnp.uint32), sds((n, 64), jnp.uint16), sds((n, 4), jnp.float32)) if fp8 else
           (sds((n, 512), jnp.float32), sds((n, 64), jnp.float32)))
  txt = _lowered_for_cuda(lambda *a: pg.sparse_mla_decode(*a[:6], a[6] if fp8 else None, 0.1, return_lse=fp8,
                                                          native_fp8=native),
                          sds((b, 128, 512), jnp.float32), sds((b, 128, 64), jnp.float32),
                          sds((b, 2048), jnp.int32), sds((b, 2048), jnp.bool_), *pools)
  assert "xla.gpu.triton" in txt and "sparse_mla_decode_gpu" in txt


def test_no_row_takes_the_triton_kernel_until_measured():
  assert backend.row("gpu").paged_scoring == "xla" and backend.row("cpu").paged_scoring == "xla"
  with backend.forced("gpu", paged_scoring="triton") as got:
    assert got.paged_scoring == "triton"
    assert not backend.pallas_interpret(None, "gpu") and backend.pallas_interpret(None)  # Triton's lowering, not Mosaic's
  assert backend.pallas_interpret(None, "gpu") == (jax.default_backend() != "gpu")  # off a GPU: the interpreter


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_the_engine_on_the_triton_kernels_decodes_the_xla_paths_tokens(monkeypatch):
  """The serving engine with its decode scores (paged_scoring) and its attention over the selected slots
  (sparse_decode: the new token merged by its lse) by the Triton kernels, interpreted here, gives the greedy
  tokens of the XLA path, the selection mattering (top-k 8 of up to 40 keys). Triton's smallest dot: 16 heads of
  each kind; the fp8 latent in 128-blocks."""
  from MaxText.checkpoint import model_state
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  from tests.conftest import make_config
  from tests.support.serving import BASE, NEW, PROMPTS
  cfg = make_config(**{**BASE, "kv_cache_dtype": "fp8", "indexer_head_dim": 128, "indexer_n_heads": 16,
                       "num_query_heads": 16, "kv_lora_rank": 128, "qk_rope_head_dim": 16, "serve_page_size": 16,
                       "serve_num_pages": 12})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  traced = []  # the kernels the engine's programs trace (the routes taken)
  for name in ("paged_index_scores", "sparse_mla_decode"):
    monkeypatch.setattr(pg, name, lambda *a, _fn=getattr(pg, name), _name=name, **kw: traced.append(_name) or _fn(*a, **kw))
  out, routes = {}, {"xla": {}, "triton": dict(paged_scoring="triton", sparse_decode="triton")}
  for name, route in routes.items():
    with backend.forced(**route):
      eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
      out[name] = [r.output for r in eng.generate(PROMPTS[:3], SamplingParams(max_tokens=NEW))]
    assert sorted(set(traced)) == ([] if name == "xla" else ["paged_index_scores", "sparse_mla_decode"])
  assert out["triton"] == out["xla"]
  assert all(len(o) == NEW for o in out["triton"])


def test_the_engines_splits_fill_the_programs_with_whole_blocks():
  """mla_splits: 16 rows x 4 head blocks of the official 128 heads = 64 programs -> 2 splits; 1 row -> 32; few slots
  -> as many whole 32-slot blocks as there are; already enough programs -> 1."""
  assert paged_cache.mla_splits(16, 128, 2048) == 2
  assert paged_cache.mla_splits(1, 128, 2048) == 32
  assert paged_cache.mla_splits(1, 128, 96) == 1 and paged_cache.mla_splits(1, 128, 128) == 4
  assert paged_cache.mla_splits(64, 128, 2048) == 1 and paged_cache.mla_splits(4, 16, 32) == 1


@pytest.mark.parametrize("take", [True, False])
def test_merge_row_is_the_softmax_over_the_union(take):
  """merge_row's (set output, its lse) + one more key equals attention over the set and the key together; an
  empty set (lse -inf) gives the key's row, an empty union 0."""
  from MaxText.kernels.cached_attention import merge_row
  k = jax.random.split(jax.random.key(5), 4)
  logits = jax.random.normal(k[0], (2, 3, 5)) * 3  # [b,h,k]: the set's scaled logits
  vals = jax.random.normal(k[1], (2, 5, 8))  # [b,k,c]
  extra, row = jax.random.normal(k[2], (2, 3)) * 3, jax.random.normal(k[3], (2, 8))
  o = jnp.einsum("bhk,bkc->bhc", jax.nn.softmax(logits, -1), vals)
  lse = jax.nn.logsumexp(logits, -1)
  got = merge_row(o, lse, extra, row, jnp.array([take, take]))
  if take:
    p = jax.nn.softmax(jnp.concatenate([logits, extra[..., None]], -1), -1)  # [b,h,k+1]
    want = jnp.einsum("bhk,bkc->bhc", p[..., :5], vals) + p[..., 5:] * row[:, None]
  else:
    want = o
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  empty = jnp.full((2, 3), -jnp.inf)
  np.testing.assert_allclose(merge_row(jnp.zeros_like(o), empty, extra, row, jnp.array([True, False])),
                             jnp.stack([jnp.broadcast_to(row[0], (3, 8)), jnp.zeros((3, 8))]), rtol=1e-6)


def test_the_kernels_lse_is_the_log_of_its_softmax_denominator():
  q_abs, q_pe, ids, valid, c_kv, k_pe, s = _mla_case(True)
  o, lse = pg.sparse_mla_decode(q_abs, q_pe, ids, valid, c_kv, k_pe, s, 0.1, block=16, heads_per_program=16,
                                return_lse=True)
  o2, lse2 = pg.sparse_mla_decode(q_abs, q_pe, ids, valid, c_kv, k_pe, s, 0.1, block=16, heads_per_program=16,
                                  return_lse=True, splits=2)  # merged from two splits: the same lse
  np.testing.assert_allclose(lse2, lse, rtol=1e-6)
  close(o2, o, 1e-6)
  np.testing.assert_array_equal(o, pg.sparse_mla_decode(q_abs, q_pe, ids, valid, c_kv, k_pe, s, 0.1, block=16,
                                                        heads_per_program=16))
  c = pd.as_values(c_kv).astype(jnp.float32).reshape(N, -1, 128) * s[..., None]  # [N, c/128, 128]
  pe = pd.as_values(k_pe).astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  logits = (jnp.einsum("bhc,bkc->bhk", q_abs, c.reshape(N, -1)[ids], precision=hi)
            + jnp.einsum("bhr,bkr->bhk", q_pe, pe[ids], precision=hi)) * 0.1  # [B,H,K]
  want = jax.nn.logsumexp(jnp.where(valid[:, None], logits, -jnp.inf), -1)  # row 1: nothing valid, -inf
  assert np.isneginf(np.asarray(lse)[1]).all()
  np.testing.assert_allclose(lse[0], want[0], rtol=1e-5)


def test_attend_selected_on_page_shards_equals_one_device():
  """paged_cache.attend_selected on a mesh of 2 page shards (each device its own rows over its own pages, the
  kernel inside shard_map) equals the one-device call, over a scanned stack's pools read by layer."""
  from MaxText.runtime import sharding
  from tests.conftest import make_config
  if jax.device_count() < 2:  # one GPU (the device check): no second page shard
    pytest.skip("needs 2 devices")
  cfg = make_config(kv_cache_dtype="fp8", num_query_heads=16, kv_lora_rank=512, qk_rope_head_dim=16,
                    indexer_head_dim=128, serve_page_size=PAGE, ici_data_parallelism=2, num_devices=2)
  pages, layers = 8, 2  # 4 pages a shard; row 0's pages on shard 0, row 1's on shard 1
  pools = paged_pools.init_layer_pools(cfg, pages * PAGE, layers)
  k = jax.random.split(jax.random.key(7), 8)
  codes = jax.random.randint(k[0], (layers, pages * PAGE, 512), 0, 126, jnp.int32).astype(jnp.uint8)  # finite e4m3
  assert pools.c_kv.dtype == jnp.uint32  # the gpu row's latent: 4 codes a word
  pools = pools._replace(c_kv=to_words(codes),
                         k_pe=bits(jax.random.normal(k[1], pools.k_pe.shape), jnp.bfloat16),
                         c_kv_scale=jax.random.uniform(k[2], pools.c_kv_scale.shape, minval=0.5, maxval=1.5) / 64)
  table = jnp.array([[2, 0, 3, 1], [5, 7, 4, 6]], jnp.int32)  # [B,P]
  idx = jax.random.randint(k[3], (2, 32), 0, 4 * PAGE)  # positions
  valid = jax.random.uniform(k[4], (2, 32)) < 0.8
  q_abs, q_pe = jax.random.normal(k[5], (2, 16, 512)) * 0.1, jax.random.normal(k[6], (2, 16, 16)) * 0.1
  layer = jnp.int32(1)
  args = (table, idx, valid, q_abs, q_pe, PAGE, 0.1, layer)
  one_o, one_lse = paged_cache.attend_selected(pools, *args)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    sharded = jax.device_put(pools, paged_pools.pool_shardings(cfg, mesh, pools))
    o, lse = jax.jit(lambda p, *a: paged_cache.attend_selected(p, *a, PAGE, 0.1, layer))(sharded, *args[:5])
  close(o, one_o, 1e-6)
  np.testing.assert_allclose(lse, one_lse, rtol=1e-6)
  # and the one-device call is the XLA reference over layer 1's pool
  flat = jax.tree.map(lambda a: a[1], pools)
  ids = jnp.take_along_axis(table, idx // PAGE, axis=1) * PAGE + idx % PAGE
  close(one_o, pd.sparse_mla_decode_xla(q_abs, q_pe, ids, valid, flat.c_kv, flat.k_pe, flat.c_kv_scale, 0.1), 1e-5)
