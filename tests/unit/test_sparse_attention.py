"""The gather path of sparse MLA (MaxText/kernels/sparse_attention.py) against the mask path:
forward and gradients (x and every parameter) under ties, short rows, padding, approximate
selection, ragged query blocks and the sparse indexer stage; the absorbed pieces against the
expanded attention; the selection as indices; and context parallelism on simulated devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.kernels import backend, selection
from MaxText.kernels import sparse_attention as sa
from MaxText.kernels import topk_indices as ti
from MaxText.kernels.masks import attention_validity
from MaxText.layers.attention_mla import MLA, capture_selection
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.attention_reference import (
  make_mla,
  mla_inputs,
  np_index_scores,
  np_kl,
  np_mla,
  np_topk_mask,
  rel_err,
)
from tests.support.precision import f32_rtol

pytestmark = pytest.mark.device  # on one GPU or TPU too (tools/device/device_check.sh); not the meshes

T, K, BLOCK = 13, 4, 5  # t is no multiple of the query block: the last block is padded


@functools.partial(jax.jit, static_argnums=0)
def _forward_and_grads(graphdef, params, rest, x, pos, seg, r):
  """out, aux, the sown selection, and d(sum(out * r) + indexer_loss) / d(params, x)."""
  def loss(params, x):
    (out, aux), inter = capture_selection(nnx.merge(graphdef, params, rest), x, pos, seg)
    return jnp.sum(out * r) + aux["indexer_loss"], (out, aux, inter)

  (_, (out, aux, inter)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return out, aux, inter, grads


def _run(m: MLA, x, pos, seg=None):
  r = jnp.asarray(np.random.default_rng(7).standard_normal(x.shape), jnp.float32)
  out, aux, inter, (g_params, g_x) = _forward_and_grads(*nnx.split(m, nnx.Param, ...), x, pos, seg, r)
  grads = {jax.tree_util.keystr(path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(g_params)}
  grads["x"] = np.asarray(g_x)
  return np.asarray(out), float(aux["indexer_loss"]), inter, grads


def _selection_of(inter, t: int) -> np.ndarray:
  """The selection a call sowed, as a bool [b,t,s] mask (the mask path's, or from the indices)."""
  if "indexer_mask" in inter:
    return np.asarray(inter["indexer_mask"][0])
  idx = np.asarray(inter["indexer_topk_indices"][0])  # [b,t,k], -1 = invalid slot
  mask = np.zeros(idx.shape[:2] + (t,), bool)
  b_i, t_i, k_i = np.nonzero(idx >= 0)
  mask[b_i, t_i, idx[b_i, t_i, k_i]] = True
  assert (np.sort(idx, -1)[..., 1:] != np.sort(idx, -1)[..., :-1])[np.sort(idx, -1)[..., 1:] >= 0].all(), \
      "a key selected twice"
  return mask


def _pair(seed, **overrides):
  """The same MLA (same parameters) on the mask path and on the gather path."""
  cfg, mask_mla = make_mla(seed, indexer_topk=K, sparse_attention_impl="mask", **overrides)
  _, gather_mla = make_mla(seed, indexer_topk=K, sparse_attention_impl="gather", sparse_attention_query_block=BLOCK,
                        **overrides)
  assert not mask_mla.use_gather(T) and gather_mla.use_gather(T)
  return cfg, mask_mla, gather_mla


def _assert_paths_agree(mask_mla, gather_mla, x, pos, seg=None, tol=2e-5):
  out_m, loss_m, inter_m, g_m = _run(mask_mla, x, pos, seg)
  out_g, loss_g, inter_g, g_g = _run(gather_mla, x, pos, seg)
  sel_m, sel_g = _selection_of(inter_m, x.shape[1]), _selection_of(inter_g, x.shape[1])
  np.testing.assert_array_equal(sel_g, sel_m)
  assert rel_err(out_g, out_m) <= tol
  np.testing.assert_allclose(loss_g, loss_m, rtol=tol, atol=1e-7)
  assert set(g_g) == set(g_m)
  for name in g_m:
    assert np.abs(g_g[name] - g_m[name]).max() <= tol * np.abs(g_m[name]).max() + 1e-8, name
  return sel_m, out_m, loss_m, g_m


def _kth_is_tied(scores: np.ndarray, k: int) -> bool:
  """Whether some row's k-th largest finite score equals its (k+1)-th (a tie at the cutoff)."""
  s = np.sort(np.where(np.isfinite(scores), scores, -np.inf), -1)[..., ::-1]
  return bool(np.any(np.isfinite(s[..., k]) & (s[..., k - 1] == s[..., k])))


def _index_scores(m: MLA, x, pos, seg=None):
  valid = attention_validity(pos, pos, seg, seg)
  return np.asarray(jax.jit(lambda x: m.indexer(x, m.project_q(x, pos)[2], pos, valid))(x))


# ---------------------------------------------------------------- gather path == mask path

@pytest.mark.parametrize("stage", ["none", "sparse"])
def test_gather_equals_mask_forward_and_gradients(stage):
  cfg, mask_mla, gather_mla = _pair(20, indexer_training_stage=stage)
  x, pos = mla_inputs(cfg, t=T, seed=20)
  sel, out, loss, grads = _assert_paths_agree(mask_mla, gather_mla, x, pos)
  counts = sel.sum(-1)
  assert (counts[:, :K] == np.arange(1, K + 1)).all() and (counts[:, K:] == K).all()  # short rows, then k
  assert all(np.abs(g).max() > 0 for n, g in grads.items() if "indexer" not in n)
  if stage == "sparse":  # the KL is on, and trains the indexer on both paths
    assert loss > 1e-3 and all(np.abs(g).max() > 0 for n, g in grads.items() if "indexer" in n)
  else:
    assert loss == 0.0 and all(np.all(g == 0) for n, g in grads.items() if "indexer" in n)


def test_sparse_stage_indexer_loss_is_the_float64_kl_over_the_selection_on_both_paths():
  # L_I = mean_t KL(p_t || softmax(I_t)) over S_t: p_t the sparse attention's probabilities summed
  # over heads, I_t the indexer scores, S_t their top-k, all from a float64 oracle of the layer.
  cfg, mask_mla, gather_mla = _pair(22, indexer_training_stage="sparse")
  x, pos = mla_inputs(cfg, t=T, seed=22)
  scores = np_index_scores(mask_mla, x, pos, np.asarray(attention_validity(pos, pos)))  # [b,t,s]
  assert not _kth_is_tied(scores.astype(np.float32), K), "a near tie at the k-th score: pick another seed"
  support = np_topk_mask(scores, K)  # [b,t,s]
  _, probs = np_mla(mask_mla, x, pos, support, with_probs=True)  # [b,h,t,s]
  want = np_kl(probs, scores, support)
  assert want > 1e-2
  for m in (mask_mla, gather_mla):
    _, loss, inter, _ = _run(m, x, pos)
    np.testing.assert_array_equal(_selection_of(inter, T), support)
    np.testing.assert_allclose(loss, want, rtol=f32_rtol(1e-5))


def test_gather_equals_mask_with_ties_at_the_kth_score():
  # One indexer head: a key scores exactly 0 wherever relu clips it, so ties at the k-th value
  # are common; the exact-k selection takes the lowest positions first on both paths.
  cfg, mask_mla, gather_mla = _pair(21, indexer_n_heads=1, indexer_training_stage="sparse")
  x, pos = mla_inputs(cfg, t=T, seed=21)
  assert _kth_is_tied(_index_scores(mask_mla, x, pos), K), "no tie at the k-th score: pick another seed"
  _assert_paths_agree(mask_mla, gather_mla, x, pos)


def test_gather_equals_mask_when_every_score_ties():
  # Identical indexer keys (no key projection, no rotary bias): every key of a row scores the same.
  cfg, mask_mla, gather_mla = _pair(22, indexer_training_stage="sparse")
  for m in (mask_mla, gather_mla):
    m.indexer.wk.kernel[...] = jnp.zeros_like(m.indexer.wk.kernel[...])
    m.indexer.k_norm.bias[...] = m.indexer.k_norm.bias[...].at[:cfg.qk_rope_head_dim].set(0.0)
  x, pos = mla_inputs(cfg, t=T, seed=22)
  sel, _, _, _ = _assert_paths_agree(mask_mla, gather_mla, x, pos)
  np.testing.assert_array_equal(sel[:, K:], np.broadcast_to(np.arange(T) < K, sel[:, K:].shape))  # first k keys


def test_gather_equals_mask_with_segments_and_padding():
  cfg, mask_mla, gather_mla = _pair(23, indexer_training_stage="sparse")
  x, _ = mla_inputs(cfg, t=T, seed=23)
  seg = jnp.asarray([[1] * 6 + [2] * 4 + [0] * 3, [1] * 10 + [0] * 3], jnp.int32)
  pos = jnp.asarray([list(range(6)) + list(range(4)) + [0] * 3, list(range(10)) + [0] * 3], jnp.int32)
  sel, out, _, grads = _assert_paths_agree(mask_mla, gather_mla, x, pos, seg)
  np.testing.assert_array_equal(out[0, 10:], 0.0)  # padding queries attend to nothing
  assert not sel[0, 6:, :6].any() and not sel[:, :, 10:].any()
  assert (sel[0, 6:10].sum(-1) == [1, 2, 3, 4]).all()  # the second segment restarts: short rows
  assert np.isfinite(grads["x"]).all()


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("exact_topk", [True, False])
def test_gather_equals_mask_with_approximate_selection(exact_topk):
  # s = 64, k = 8: the binned approximate top-k really runs (no fallback to lax.top_k).
  t, k = 64, 8
  assert selection.binned_config(t, k, 0.95) is not None
  cfg, mask_mla = make_mla(24, indexer_topk=k, indexer_use_approx_top_k=True, sparse_attention_impl="mask",
                        indexer_mask_exact_topk=exact_topk, indexer_training_stage="sparse")
  _, gather_mla = make_mla(24, indexer_topk=k, indexer_use_approx_top_k=True, sparse_attention_impl="gather",
                        sparse_attention_query_block=24, indexer_mask_exact_topk=exact_topk,
                        indexer_training_stage="sparse")
  x, pos = mla_inputs(cfg, t=t, seed=24)
  if exact_topk:  # the mask is the approximate index set: the same set on both paths
    _assert_paths_agree(mask_mla, gather_mla, x, pos)
    return
  # A raw cutoff at the smallest approximate value can take more than k keys (any key the
  # approximation missed that scores above it); the gather path keeps exactly its k indices.
  _, _, inter_m, _ = _run(mask_mla, x, pos)
  _, _, inter_g, _ = _run(gather_mla, x, pos)
  sel_m, sel_g = _selection_of(inter_m, t), _selection_of(inter_g, t)
  assert not (sel_g & ~sel_m).any()
  np.testing.assert_array_equal(sel_g.sum(-1), np.minimum(np.arange(1, t + 1), k)[None].repeat(2, 0))


def test_raw_cutoff_mask_exceeds_k_under_ties_but_gather_takes_exactly_k():
  # indexer_mask_exact_topk=false: without ties both paths agree; with ties at the k-th value the
  # mask path takes every tied key, the gather path exactly k of them (lowest positions first),
  # i.e. the gather path always equals the mask path with indexer_mask_exact_topk=true.
  cfg, raw_mask = make_mla(25, indexer_topk=K, indexer_n_heads=1, indexer_mask_exact_topk=False,
                        sparse_attention_impl="mask")
  _, exact_mask = make_mla(25, indexer_topk=K, indexer_n_heads=1, sparse_attention_impl="mask")
  _, gather_mla = make_mla(25, indexer_topk=K, indexer_n_heads=1, indexer_mask_exact_topk=False,
                        sparse_attention_impl="gather", sparse_attention_query_block=BLOCK)
  x, pos = mla_inputs(cfg, t=T, seed=25)
  assert _kth_is_tied(_index_scores(raw_mask, x, pos), K)
  sel_raw = _selection_of(_run(raw_mask, x, pos)[2], T)
  out_g, _, inter_g, _ = _run(gather_mla, x, pos)
  out_e, _, inter_e, _ = _run(exact_mask, x, pos)
  sel_g = _selection_of(inter_g, T)
  assert (sel_raw.sum(-1) > K).any() and (sel_g.sum(-1) <= K).all() and not (sel_g & ~sel_raw).any()
  np.testing.assert_array_equal(sel_g, _selection_of(inter_e, T))
  assert rel_err(out_g, out_e) <= 2e-5
  untied = (sel_raw.sum(-1) <= K)  # rows without extra tied keys: the raw mask agrees too
  np.testing.assert_array_equal(sel_g[untied], sel_raw[untied])


def test_queries_with_at_most_k_keys_equal_dense_causal_attention():
  cfg, _, gather_mla = _pair(26)
  _, dense = make_mla(26, use_indexer=False)
  x, pos = mla_inputs(cfg, t=T, seed=26)
  out_g, _, _, _ = _run(gather_mla, x, pos)
  out_d, _, _, _ = _run(dense, x, pos)
  assert rel_err(out_g[:, :K], out_d[:, :K]) <= 2e-5  # rows 0..k-1 see <= k keys
  assert rel_err(out_g[:, K:], out_d[:, K:]) > 1e-2  # later rows really are sparse


def test_auto_switches_at_the_min_length_and_dense_warmup_stays_on_the_mask_path():
  cfg = make_config(sparse_attention_impl="auto", sparse_attention_gather_min_length=32)
  m = MLA(cfg, rngs=nnx.Rngs(0))
  assert not m.use_gather(31) and m.use_gather(32) and m.use_gather(1000)
  assert not MLA(make_config(sparse_attention_impl="gather", indexer_training_stage="dense_warmup"),
                 rngs=nnx.Rngs(0)).use_gather(1000)
  assert not MLA(make_config(sparse_attention_impl="gather", use_indexer=False), rngs=nnx.Rngs(0)).use_gather(1000)
  assert not MLA(make_config(sparse_attention_impl="mask"), rngs=nnx.Rngs(0)).use_gather(10 ** 6)


# ---------------------------------------------------------------- the pieces

def test_absorbed_attention_equals_expanded_attention():
  cfg, m = make_mla(27, indexer_topk=K)
  x, pos = mla_inputs(cfg, t=T, seed=27)
  rng = np.random.default_rng(27)
  idx = jnp.asarray(rng.integers(0, T, (2, T, 6)), jnp.int32)
  ok = jnp.asarray(rng.random((2, T, 6)) < 0.7).at[:, 3].set(False)  # row 3 has no valid slot
  ok = ok & (idx <= jnp.arange(T)[None, :, None])  # only keys at or before the query
  # the same slot twice would count twice in the gather path: keep the first of duplicates
  first = (idx[..., :, None] == idx[..., None, :]) & (jnp.arange(6)[:, None] > jnp.arange(6)[None, :])
  ok = ok & ~jnp.any(first & ok[..., None, :], axis=-1)

  @jax.jit
  def both(x):
    q_nope, q_pe, _ = m.project_q(x, pos)
    c_kv, k_pe = m.project_kv(x, pos)
    w = m.wkv_b.kernel[...]
    q_lat = sa.absorb_q(q_nope, w, m.num_heads, m.nope, m.v_dim)  # [b,t,h,c]
    o_lat, probs = sa.gather_attend(q_lat, q_pe, c_kv, k_pe, idx, ok, cfg.softmax_scale)
    rows = lambda a: jax.vmap(lambda ab, ib: ab[ib])(a, idx).reshape(2, -1, a.shape[-1])  # [b,t*6,e]: in order
    o_given, _ = sa.gather_attend(q_lat, q_pe, rows(c_kv), rows(k_pe), None, ok, cfg.softmax_scale)  # the cache's way
    o_lat = jnp.where(jnp.array_equal(o_given, o_lat), o_lat, jnp.nan)  # idx None: the same rows, the same output
    absorbed = sa.unabsorb_out(o_lat, w, m.num_heads, m.nope, m.v_dim)  # [b,t,h,v]
    mask = jnp.zeros((2, T, T), bool).at[jnp.arange(2)[:, None, None], jnp.arange(T)[None, :, None], idx].max(ok)
    k_nope, v = m.expand_kv(c_kv)
    expanded, probs_dense = m.attend(q_nope, q_pe, k_nope, k_pe, v, mask)
    return absorbed, expanded, probs, jnp.take_along_axis(probs_dense, idx[:, None], axis=-1), mask

  absorbed, expanded, probs, probs_dense_at_idx, mask = both(x)
  assert np.asarray(mask).any(-1).sum() > 10
  assert rel_err(absorbed, expanded) <= 1e-5
  np.testing.assert_allclose(np.where(ok[:, None], probs, 0), np.where(ok[:, None], probs_dense_at_idx, 0),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(probs)[~np.broadcast_to(np.asarray(ok)[:, None], probs.shape)], 0.0)
  np.testing.assert_array_equal(np.asarray(absorbed)[:, 3], 0.0)  # no valid slot: output 0, no NaN


def test_topk_indices_is_lax_top_k_set_with_ties_nan_and_short_rows():
  rng = np.random.default_rng(28)
  s, k = 300, 17
  x = rng.integers(0, 6, (4, 9, s)).astype(np.float32)  # heavy ties
  x[:, 0, 5:] = -np.inf  # 5 finite keys < k
  x[:, 1, :] = -np.inf  # none
  x[:, 2, ::3] = np.nan
  x[:, 3] = rng.standard_normal(s)  # no ties
  idx, ok = jax.jit(lambda x: ti.topk_indices(x, k))(jnp.asarray(x))
  idx, ok = np.asarray(idx), np.asarray(ok)
  clean = np.where(np.isnan(x), -np.inf, x)
  want_idx = np.asarray(jax.lax.top_k(jnp.asarray(clean), k)[1])
  want_ok = np.take_along_axis(clean, want_idx, -1) > -np.inf
  for r in np.ndindex(*x.shape[:2]):
    assert set(idx[r][ok[r]]) == set(want_idx[r][want_ok[r]]), r
    assert ok[r].sum() == want_ok[r].sum() and (np.diff(idx[r][ok[r]]) > 0).all()  # ascending, distinct
  assert ok[:, 0].sum(-1).tolist() == [5] * 4 and not ok[:, 1].any()
  # approximate: the select_topk indices, valid where finite
  values, a_idx = selection.select_topk(jnp.asarray(x), k, approx=True)
  idx_a, ok_a = ti.topk_indices(jnp.asarray(x), k, approx=True)
  np.testing.assert_array_equal(np.asarray(idx_a), np.asarray(a_idx))
  np.testing.assert_array_equal(np.asarray(ok_a), np.asarray(values) > -np.inf)


@pytest.mark.parametrize("placement", ["search", "compare", "grouped"])
def test_mask_to_indices_round_trips_random_masks(placement):
  """Every placement (backend.py index_placement: the CPU's binary search, the TPU's counting, counting in groups
  of words) gives each row's selected positions ascending, and exactly them. 4100 keys: 129 words, groups of 16
  with the last one padded."""
  rng = np.random.default_rng(29)
  for s in (1, 31, 32, 33, 200, 4100):
    k = max(1, s // 3)
    scores = rng.standard_normal((3, 5, s))
    mask = (scores > np.sort(scores, -1)[..., -k:][..., :1] - 1e-9) & (rng.random((3, 5, s)) < 0.8)
    mask[0, 0] = False  # a row with nothing selected
    mask[0, 1, :k] = True  # a full row
    mask[0, 1, k:] = False
    with backend.forced(index_placement=placement):  # a fresh function: jit's cache would keep another choice
      idx, ok = jax.jit(lambda m, k=k: ti.mask_to_indices(m, k))(jnp.asarray(mask))
    back = np.zeros_like(mask)
    for r in np.ndindex(*mask.shape[:2]):
      back[r][np.asarray(idx)[r][np.asarray(ok)[r]]] = True
    np.testing.assert_array_equal(back, mask)
    np.testing.assert_array_equal(np.asarray(ok).sum(-1), mask.sum(-1))
    idx, ok = np.asarray(idx), np.asarray(ok)
    assert all((np.diff(idx[r][ok[r]]) > 0).all() for r in np.ndindex(*mask.shape[:2]))  # ascending
    assert (idx[~ok] == 0).all()  # then 0


def _driver_inputs(seed=30, b=2, t=11, s=11, h=3, nope=4, r=2, v=5, c=6, H=2, d=4):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return dict(q_nope=f(b, t, h, nope), q_pe=f(b, t, h, r), c_kv=f(b, s, c), k_pe=f(b, s, r),
              wkv_b_kernel=f(c, h * (nope + v)), index_q=f(b, t, H, d), index_w=f(b, t, H), index_k=f(b, s, d),
              positions=pos), dict(num_heads=h, nope=nope, v=v)


_DIFF = ("q_nope", "q_pe", "c_kv", "k_pe", "wkv_b_kernel", "index_q", "index_w", "index_k")


def _driver_grad(arrays, dims, **spec):
  """jit(value_and_grad) of sparse_mla_attention's output (a fixed projection) + KL in every float input
  (_DIFF), its outputs as aux; spec: SparseSpec's fields beyond dims and scale. -> (the jitted fn, its args)"""
  def loss(*xs):
    a = dict(arrays, **dict(zip(_DIFF, xs)))
    queries = sa.SparseQueries(a["q_nope"], a["q_pe"], a["index_q"], a["index_w"], a["positions"], None)
    keys = sa.SparseKeys(a["c_kv"], a["k_pe"], a["index_k"], a["positions"], None)
    out, idx, ok, kl = sa.sparse_mla_attention(queries, keys, a["wkv_b_kernel"], sa.SparseSpec(**dims, scale=0.3, **spec))
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))) + kl, (out, idx, ok, kl)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(_DIFF))), has_aux=True)), \
      tuple(arrays[n] for n in _DIFF)


@pytest.mark.parametrize("b", [1, 2])
def test_query_loop_vmap_and_block_sizes_agree_in_values_and_gradients(b):
  """The CPU schedule (a loop over queries, the keys' cotangent scatter-added in place) equals the
  vmapped one (other backends), with one block or several padded ones; b = 1 skips the vmap."""
  arrays, dims = _driver_inputs(b=b)
  diff = _DIFF

  def run(query_block, query_loop):
    fn, args = _driver_grad(arrays, dims, topk=4, query_block=query_block, head_chunk=1, with_kl=True,
                            query_loop=query_loop)
    return fn(*args)

  (_, (out1, idx1, ok1, kl1)), g1 = run(11, False)  # one block, vmapped
  (_, (out2, idx2, ok2, kl2)), g2 = run(4, True)  # 3 blocks of 4 (one padding row), a loop over queries
  np.testing.assert_array_equal(np.asarray(idx1), np.asarray(idx2))
  np.testing.assert_array_equal(np.asarray(ok1), np.asarray(ok2))
  assert rel_err(out2, out1) <= 1e-5 and abs(float(kl2) - float(kl1)) <= 1e-5 * abs(float(kl1)) and float(kl1) > 0
  for name, a, b_ in zip(diff, g1, g2):
    assert np.abs(np.asarray(a)).max() > 0, name
    assert rel_err(b_, a) <= 1e-5, name


def test_block_remat_keeps_a_blocks_queries_not_its_absorbed_ones_and_changes_no_value():
  """sparse_attention_block_remat: the lax.map's residuals for the backward pass are a block's q_nope and q_pe
  ([t,h,nope+r]), not its absorbed queries and latent outputs ([t,h,c+r] and [t,h,c]); values and gradients
  the same (the attention recomputed from the same inputs)."""
  arrays, dims = _driver_inputs(b=1, t=512, s=512, h=16, nope=8, r=4, v=8, c=64, H=2, d=8)
  got, temp = {}, {}
  for remat in (True, False):
    fn, args = _driver_grad(arrays, dims, topk=8, query_block=32, head_chunk=1, with_kl=True, query_loop=False,
                            block_remat=remat)
    temp[remat] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    got[remat] = fn(*args)
  stacked = 512 * 16 * (64 + 4 + 64) * 4  # the absorbed queries and latent outputs of every block, f32
  if jax.default_backend() == "cpu":  # XLA:CPU's buffer assignment; a v5e's memory analysis of this program is 0
    assert temp[False] - temp[True] >= stacked // 2, temp
  (_, (out1, idx1, _, kl1)), g1 = got[True]
  (_, (out0, idx0, _, kl0)), g0 = got[False]
  np.testing.assert_array_equal(np.asarray(idx1), np.asarray(idx0))
  assert rel_err(out1, out0) <= 1e-6 and abs(float(kl1) - float(kl0)) <= 1e-6 * abs(float(kl0))
  for name, a, b_ in zip(_DIFF, g0, g1):
    assert rel_err(b_, a) <= 1e-6, name


# ---------------------------------------------------------------- context parallelism

@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (8 simulated CPU devices in tests/conftest.py)")
def test_context_parallel_gather_path_equals_one_device(cp):
  t = 16  # two query blocks of 8, each spread over the cp devices
  cfg1 = make_config(indexer_topk=K, sparse_attention_impl="gather", sparse_attention_query_block=8,
                     indexer_training_stage="sparse")
  cfg = make_config(indexer_topk=K, sparse_attention_impl="gather", sparse_attention_query_block=8,
                    indexer_training_stage="sparse", num_devices=cp, ici_context_parallelism=cp)
  m = MLA(cfg1, rngs=nnx.Rngs(31))
  graphdef1, params, rest = nnx.split(m, nnx.Param, ...)
  graphdef = nnx.split(MLA(cfg, rngs=nnx.Rngs(31)), nnx.Param, ...)[0]
  x, pos = mla_inputs(cfg, t=t, seed=31)
  r = jnp.asarray(np.random.default_rng(31).standard_normal(x.shape), jnp.float32)
  # the context-parallel run sees the sequence as training feeds it: zig-zag reordered (load balancing)
  perm = sharding.load_balance_permutation(t, cp)
  inverse = np.argsort(perm)

  def step(graphdef, r):
    def f(params, x, pos):
      def loss(params, x):
        out, aux = nnx.merge(graphdef, params, rest)(x, pos)
        return jnp.sum(out * r) + aux["indexer_loss"], (out, aux["indexer_loss"])
      return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return f

  one_device = jax.jit(step(graphdef1, r)).lower(params, x, pos).compile()
  (_, (out1, kl1)), (gp1, gx1) = one_device(params, x, pos)
  mesh = sharding.create_mesh(cfg)
  seq = NamedSharding(mesh, P(None, "context"))
  assert cfg.context_parallel_load_balance
  x, pos = x[:, perm], pos[:, perm]
  with sharding.logical_rules(cfg, mesh):
    fn = jax.jit(step(graphdef, r[:, perm]), in_shardings=(NamedSharding(mesh, P()),
                                                           NamedSharding(mesh, P(None, "context", None)), seq))
    compiled = fn.lower(params, x, pos).compile()
    (_, (out, kl)), (gp, gx) = compiled(params, jax.device_put(x, NamedSharding(mesh, P(None, "context", None))),
                                        jax.device_put(pos, seq))
  assert out.sharding.spec[1] == "context"
  out, gx = out[:, inverse], gx[:, inverse]  # back to original order
  assert rel_err(out, out1) <= 1e-5 and abs(float(kl) - float(kl1)) <= 1e-5 * abs(float(kl1))
  assert rel_err(gx, gx1) <= 1e-5
  for a, b in zip(jax.tree.leaves(gp1), jax.tree.leaves(gp)):
    assert np.abs(np.asarray(b) - np.asarray(a)).max() <= 1e-5 * max(np.abs(np.asarray(a)).max(), 1e-6)
  # each device scores and attends only its own t/cp queries (not the replicated computation)
  flops1, flops = one_device.cost_analysis()["flops"], compiled.cost_analysis()["flops"]
  assert flops < 1.5 * flops1 / cp


# ---------------------------------------------------------------- memory in training


def _largest_buffer(compiled) -> tuple[int, str]:
  """(elements, shape text) of the largest array any instruction of a compiled program produces."""
  import re
  best = (0, "")
  for m in re.finditer(r"\b(?:pred|s8|u8|s32|u32|f32|bf16)\[([0-9,]+)\]", compiled.as_text()):
    n = int(np.prod([int(d) for d in m.group(1).split(",")]))
    best = max(best, (n, m.group(0)))
  return best


@pytest.mark.parametrize("stage", ["none", "sparse"])
def test_training_scanned_layers_on_the_gather_path_keeps_no_t_by_s_buffer(stage):
  # The whole model's gradient with scanned, rematerialized layers (the training default): no
  # buffer of t*s/2 or more elements anywhere, not even a bool [t,s] validity mask (JAX split the
  # per-block masks of the query loop into a loop of their own and stacked them: 16 GiB at 128K).
  # Dense layers only: the experts' matmul has buffers of its own (on XLA:CPU ragged_dot, the GPU
  # row's, holds [E, t*k, D]), none t*s.
  from MaxText.checkpoint import model_state
  t = 2048
  cfg = make_config(max_target_length=t, max_position_embeddings=t, indexer_topk=16, mtp_num_layers=0,
                    first_num_dense_layers=4,
                    sparse_attention_impl="gather", sparse_attention_query_block=64, scan_layers=True,
                    remat_policy="full", indexer_training_stage=stage)
  graphdef, params, buffers = model_state.abstract_model(cfg)
  params, buffers = params.to_pure_dict(), buffers.to_pure_dict()  # shapes only: nothing is allocated
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def loss(params, buffers, tokens):
    logits, aux = model_state.merge(graphdef, params, buffers)(tokens)
    return jnp.mean(logits) + aux["indexer_loss"]

  compiled = jax.jit(jax.grad(loss)).lower(params, buffers, tokens).compile()
  n, shape = _largest_buffer(compiled)
  assert n < t * t // 2, f"the training step holds {shape}"


def test_onehot_rows_takes_any_int32_row_bit_for_bit():
  # topk_indices.onehot_rows (the grouped placement's and lookup_pages' row take without a gather): one-hot x bytes
  # in bf16, fp32 accumulation: exact for every int32, negatives (a word's top bit) and the extremes included.
  rng = np.random.default_rng(4)
  table = rng.integers(-2**31, 2**31, (2, 3, 7, 5), dtype=np.int64).astype(np.int32)  # [.., G=7, c=5]
  table[0, 0, 0] = [-2**31, 2**31 - 1, -1, 0, 1]
  idx = rng.integers(0, 7, (2, 3, 9)).astype(np.int32)  # [.., m=9]
  got = np.asarray(jax.jit(ti.onehot_rows)(jnp.asarray(table), jnp.asarray(idx)))
  np.testing.assert_array_equal(got, np.take_along_axis(table, idx[..., None], axis=-2))
  hlo = jax.jit(ti.onehot_rows).lower(jnp.asarray(table), jnp.asarray(idx)).as_text()
  assert "gather" not in hlo


@pytest.mark.parametrize("loop", [False, True])
def test_attend_block_vjp_equals_autodiff_of_the_gathered_attention(loop):
  # _attend_block's flash-style VJP (the keys' cotangent one [k, e] dot of [ds | probs] with [q | do], scatter-added)
  # against plain autodiff of gather_attend on the same block: duplicate-free slots, invalid slots, a row with none.
  rng = np.random.default_rng(11)
  b, blk, h, c, r, s, k = 2, 3, 4, 6, 2, 9, 5
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, kv, ct = f(b, blk, h, c + r), f(b, s, c + r), f(b, blk, h, c)
  idx = jnp.asarray(np.stack([np.stack([rng.permutation(s)[:k] for _ in range(blk)]) for _ in range(b)]), jnp.int32)
  ok = jnp.asarray(rng.random((b, blk, k)) < 0.7).at[0, 1].set(False)

  def ours(q, kv):
    o, _ = sa._attend_block(q, kv, idx, ok, 0.4, c, loop, None)
    return jnp.sum(o * ct)

  def reference(q, kv):
    o, _ = sa.gather_attend(q[..., :c], q[..., c:], kv[..., :c], kv[..., c:], idx, ok, 0.4)
    return jnp.sum(o * ct)

  got, want = jax.jit(jax.grad(ours, (0, 1)))(q, kv), jax.jit(jax.grad(reference, (0, 1)))(q, kv)
  for g, w in zip(got, want):
    assert np.abs(np.asarray(w)).max() > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_save_attention_selection_policy_reruns_no_block_and_changes_no_gradient():
  # decoder.py's remat_policy save_attention_selection saves each block's idx, ok and p_heads (SELECTION_NAME) as well
  # as the output: under it the backward pass holds fewer loops (no block's selection and attention forward re-run
  # before the backward map) and the gradients are those of remat full (to fp32 rounding: XLA fuses the two programs apart).
  from MaxText.layers.decoder import REMAT_POLICIES
  arrays, dims = _driver_inputs(b=1, t=16, s=16)
  spec = sa.SparseSpec(**dims, scale=0.3, topk=4, query_block=4, head_chunk=1, with_kl=True, query_loop=False,
                       block_remat=True)

  def grad_fn(policy):
    def f(*xs):
      a = dict(arrays, **dict(zip(_DIFF, xs)))
      out = sa.sparse_mla_attention(sa.SparseQueries(a["q_nope"], a["q_pe"], a["index_q"], a["index_w"], a["positions"],
                                                     None),
                                    sa.SparseKeys(a["c_kv"], a["k_pe"], a["index_k"], a["positions"], None),
                                    a["wkv_b_kernel"], spec)
      return jnp.sum(out.out * jnp.cos(jnp.arange(out.out.size).reshape(out.out.shape))) + out.indexer_loss
    return jax.grad(jax.checkpoint(f, policy=policy), argnums=tuple(range(len(_DIFF))))

  args = tuple(arrays[n] for n in _DIFF)
  full, saved = grad_fn(REMAT_POLICIES["full"]), grad_fn(REMAT_POLICIES["save_attention_selection"])
  loops = {name: str(jax.make_jaxpr(fn)(*args)).count("scan[") for name, fn in (("full", full), ("saved", saved))}
  assert loops["saved"] < loops["full"], loops
  for name, a, b_ in zip(_DIFF, jax.jit(full)(*args), jax.jit(saved)(*args)):
    assert np.abs(np.asarray(a)).max() > 0, name
    assert rel_err(b_, a) <= 1e-6, name
