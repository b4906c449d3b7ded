"""The lightning indexer: score formula, head chunking, RoPE layout, Hadamard, gradients,
selection flags, and parity with Hugging Face's DeepseekV32Indexer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import selection
from MaxText.kernels.index_scores import index_scores
from MaxText.kernels.masks import attention_validity
from MaxText.layers.embeddings import rope_inv_freq
from MaxText.layers.indexer import Indexer, hadamard_matrix
from tests.conftest import make_config
from tests.support.attention_reference import (
  copy_indexer_to_hf,
  hf_indexer_config,
  np_index_scores_of,
  np_layernorm,
  np_rope_half,
  to_torch,
)


def _randomize_norm(idx: Indexer, seed=0):
  rng = np.random.default_rng(seed)
  d = idx.head_dim
  idx.k_norm.scale[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
  idx.k_norm.bias[...] = jnp.asarray(0.3 * rng.standard_normal(d), jnp.float32)


def _inputs(cfg, b=2, t=12, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.emb_dim)), jnp.float32)
  q_lat = jnp.asarray(rng.standard_normal((b, t, cfg.q_lora_rank)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return x, q_lat, pos


def _random_qwk(b=2, t=5, s=7, h=6, d=16, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, h, d)).astype(np.float32)
  w = rng.standard_normal((b, t, h)).astype(np.float32)
  k = rng.standard_normal((b, s, d)).astype(np.float32)
  valid = rng.random((b, t, s)) < 0.7
  return q, w, k, valid


# ---------------------------------------------------------------- the score formula

def test_index_scores_match_float64_oracle_with_relu_weights_scale_and_mask():
  q, w, k, valid = _random_qwk()
  got = np.asarray(index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), jnp.asarray(valid), head_chunk=64))
  want = np_index_scores_of(q, w, k, valid)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(np.isneginf(got), ~valid)
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
  # relu matters: some q.k are negative, and dropping relu would change the scores
  assert (np.einsum("bthd,bsd->btsh", q, k) < 0).any()
  no_relu = np.einsum("bthd,bsd,bth->bts", q, k, w) * 16 ** -0.5
  assert np.abs(no_relu[valid] - want[valid]).max() > 1e-2


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 6, 8])
def test_head_chunked_scores_equal_unchunked(chunk):
  q, w, k, valid = _random_qwk(h=6, seed=1)
  args = (jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), jnp.asarray(valid))
  full = np.asarray(index_scores(*args, head_chunk=6))
  got = np.asarray(index_scores(*args, head_chunk=chunk))
  np.testing.assert_array_equal(np.isneginf(got), ~valid)
  np.testing.assert_allclose(got[valid], full[valid], rtol=1e-6, atol=1e-6)


def test_head_chunked_scores_have_gradients_equal_to_unchunked():
  q, w, k, valid = _random_qwk(h=6, seed=2)

  def loss(q, w, k, chunk):
    s = index_scores(q, w, k, jnp.asarray(valid), head_chunk=chunk)
    return jnp.sum(jnp.where(jnp.asarray(valid), s, 0.0) ** 2)

  g_full = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), 6)
  g_chunk = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), 4)
  for a, b in zip(g_full, g_chunk):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- projections: RoPE layout, Hadamard

def test_keys_and_queries_use_rotate_half_rope_on_first_rope_dims_only():
  cfg = make_config(indexer_hadamard=False)
  idx = Indexer(cfg, rngs=nnx.Rngs(0))
  _randomize_norm(idx)
  x, q_lat, pos = _inputs(cfg, t=9)
  pos = pos + 5  # positions not starting at 0
  r = cfg.qk_rope_head_dim
  inv = rope_inv_freq(cfg, r)

  k_raw = np_layernorm(np.asarray(x) @ np.asarray(idx.wk.kernel[...]), idx.k_norm.scale[...], idx.k_norm.bias[...])
  want_k = np.concatenate([np_rope_half(k_raw[..., :r], pos, inv), k_raw[..., r:]], -1)
  got_k = np.asarray(jax.jit(idx.keys)(x, pos))
  np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=1e-5)

  b, t, _ = q_lat.shape
  q_raw = (np.asarray(q_lat, np.float64) @ np.asarray(idx.wq_b.kernel[...])).reshape(b, t, cfg.indexer_n_heads, -1)
  want_q = np.concatenate([np_rope_half(q_raw[..., :r], pos, inv), q_raw[..., r:]], -1)
  got_q, got_w = jax.jit(idx.queries)(x, q_lat, pos)
  np.testing.assert_allclose(np.asarray(got_q), want_q, rtol=1e-5, atol=1e-5)
  want_w = np.asarray(x, np.float64) @ np.asarray(idx.weights_proj.kernel[...]) * cfg.indexer_n_heads ** -0.5
  assert got_w.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=1e-5, atol=1e-6)

  # the interleaved layout would give different keys: the test can tell the two apart
  ang = np.asarray(pos, np.float64)[..., None] * inv
  kr = k_raw[..., :r].reshape(b, t, r // 2, 2)
  inter = np.stack([kr[..., 0] * np.cos(ang) - kr[..., 1] * np.sin(ang),
                    kr[..., 1] * np.cos(ang) + kr[..., 0] * np.sin(ang)], -1).reshape(b, t, r)
  assert np.abs(inter - got_k[..., :r]).max() > 1e-2


def test_hadamard_matrix_is_orthogonal_and_symmetric():
  for d in (1, 2, 16, 128):
    h = hadamard_matrix(d).astype(np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
  with pytest.raises(ValueError, match="power of 2"):
    hadamard_matrix(12)


def test_hadamard_rotation_leaves_scores_unchanged():
  cfg_off, cfg_on = make_config(indexer_hadamard=False), make_config(indexer_hadamard=True)
  idx_off = Indexer(cfg_off, rngs=nnx.Rngs(3))
  _randomize_norm(idx_off)
  idx_on = Indexer(cfg_on, rngs=nnx.Rngs(4))
  nnx.update(idx_on, nnx.state(idx_off, nnx.Param))
  x, q_lat, pos = _inputs(cfg_on, t=10, seed=3)
  valid = attention_validity(pos, pos)
  s_off = np.asarray(jax.jit(idx_off.__call__)(x, q_lat, pos, valid))
  s_on = np.asarray(jax.jit(idx_on.__call__)(x, q_lat, pos, valid))
  v = np.asarray(valid)
  np.testing.assert_array_equal(np.isneginf(s_on), ~v)
  np.testing.assert_allclose(s_on[v], s_off[v], rtol=1e-4, atol=1e-5)
  # the rotation is really applied: the keys differ
  assert np.abs(np.asarray(idx_on.keys(x, pos)) - np.asarray(idx_off.keys(x, pos))).max() > 1e-2


# ---------------------------------------------------------------- gradients

def test_scores_send_no_gradient_to_inputs_but_train_indexer_params():
  cfg = make_config()
  idx = Indexer(cfg, rngs=nnx.Rngs(5))
  _randomize_norm(idx)
  x, q_lat, pos = _inputs(cfg, t=8, seed=5)
  valid = attention_validity(pos, pos)
  r = jnp.asarray(np.random.default_rng(0).standard_normal(valid.shape), jnp.float32)
  graphdef, params = nnx.split(idx, nnx.Param)

  def loss(params, x, q_lat):
    s = nnx.merge(graphdef, params)(x, q_lat, pos, valid)
    return jnp.sum(jnp.where(valid, s * r, 0.0)) + jnp.sum(jax.nn.log_softmax(s, axis=-1) * valid)

  g_params, g_x, g_q = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, q_lat)
  assert np.all(np.asarray(g_x) == 0) and np.all(np.asarray(g_q) == 0)
  grads = {_name(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(g_params)}
  assert set(grads) == {"wq_b/kernel", "wk/kernel", "k_norm/scale", "k_norm/bias", "weights_proj/kernel"}
  for name, g in grads.items():
    assert np.all(np.isfinite(g)), name
    assert np.abs(g).max() > 0, f"no gradient reaches {name}"


def _name(path):
  return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


# ---------------------------------------------------------------- selection flags

def _select(scores, **overrides):
  """Indexer.select under the config overrides, jitted (the selection's loops compile once)."""
  return jax.jit(Indexer(make_config(**overrides), rngs=nnx.Rngs(0)).select)(scores)


def _tied_scores():
  # 3 keys tie at the k-th value (k = 3): exact keeps 3, the raw cutoff keeps 4
  row = [0.5, 0.5, 0.9, 0.5, 0.1, 0.0, -1.0, -jnp.inf]
  return jnp.asarray([[row, row[::-1]]], jnp.float32)  # [1,2,8]


def test_select_exact_topk_keeps_k_under_ties_and_raw_cutoff_keeps_more():
  scores = _tied_scores()
  exact = _select(scores, indexer_topk=3, indexer_mask_exact_topk=True)
  raw = _select(scores, indexer_topk=3, indexer_mask_exact_topk=False)
  np.testing.assert_array_equal(np.asarray(exact).sum(-1), [[3, 3]])
  np.testing.assert_array_equal(np.asarray(raw).sum(-1), [[4, 4]])
  # exact = lax.top_k's set (ties lowest position first); the top score is always in
  want = selection.generate_mask_reference(jax.lax.top_k(scores, 3)[1], scores.shape[-1])
  np.testing.assert_array_equal(np.asarray(exact), np.asarray(want))
  assert bool(exact[0, 0, 2]) and bool(exact[0, 1, 5])
  assert not raw[0, 0, 7] and not raw[0, 1, 0]  # -inf never selected


def test_select_never_picks_masked_keys_when_fewer_valid_than_k():
  s = jnp.asarray([[[1.0, 2.0, -jnp.inf, -jnp.inf, -jnp.inf]]], jnp.float32)
  for exact in (True, False):
    mask = _select(s, indexer_topk=4, indexer_mask_exact_topk=exact)
    np.testing.assert_array_equal(np.asarray(mask), [[[True, True, False, False, False]]])


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_select_approx_path_follows_config():
  """The approx mask is select_topk(approx)'s index set (exact_topk) or its smallest value as a
  raw cutoff, at k = s/16 (the fused per-block mask) and k = s/256 (the index scatter)."""
  rng = np.random.default_rng(7)
  scores = jnp.asarray(rng.standard_normal((2, 4, 4096)), jnp.float32)
  for k in (256, 16):
    exact_mask = _select(scores, indexer_topk=k)
    mask = _select(scores, indexer_topk=k, indexer_use_approx_top_k=True, indexer_approx_top_k_recall=0.95)
    values, indices = selection.select_topk(scores, k, approx=True, recall_target=0.95)
    assert selection.binned_config(4096, k, 0.95) is not None
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(selection.generate_mask_reference(indices, 4096)))
    recall = (np.asarray(mask) & np.asarray(exact_mask)).sum() / np.asarray(exact_mask).sum()
    assert recall >= 0.95, (k, recall)
    raw = _select(scores, indexer_topk=k, indexer_use_approx_top_k=True, indexer_mask_exact_topk=False)
    kth = np.asarray(values).min(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(raw), np.asarray(scores) >= kth)  # the approx k-th value as raw cutoff


def test_additive_generate_mask_follows_exact_topk_flag():
  scores = _tied_scores()
  values = jax.lax.top_k(scores, 3)[0]
  for exact, n in ((True, 3), (False, 4)):
    m = Indexer(make_config(indexer_topk=3, indexer_mask_exact_topk=exact), rngs=nnx.Rngs(0)).generate_mask(
        scores, values)
    m = np.asarray(m)
    assert np.isfinite(m).all()
    np.testing.assert_array_equal((m == 0).sum(-1), [[n, n]])
    assert m.max() == 0 and m.min() < -1e30


# ---------------------------------------------------------------- Hugging Face parity


def _hf_index_scores(hf_idx, hidden, q_resid, cos, sin, mask_add):
  """HF DeepseekV32Indexer.forward's score lines, before its top-k (which returns only indices)."""
  import torch
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
  b, t, _ = hidden.shape
  q = hf_idx.wq_b(q_resid).view(b, t, hf_idx.n_heads, hf_idx.head_dim)
  r = hf_idx.qk_rope_head_dim
  q_rot, q_pass = torch.split(q, [r, hf_idx.head_dim - r], dim=-1)
  k = hf_idx.k_norm(hf_idx.wk(hidden)).unsqueeze(2)
  k_rot, k_pass = torch.split(k, [r, hf_idx.head_dim - r], dim=-1)
  q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
  q = torch.cat([q_rot, q_pass], -1)
  k = torch.cat([k_rot, k_pass], -1).squeeze(2)
  scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * hf_idx.softmax_scale)
  weights = hf_idx.weights_proj(hidden).float() * hf_idx.n_heads ** -0.5
  return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2) + mask_add


def test_indexer_matches_hf_deepseek_v32_indexer():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding
  topk, t = 5, 14
  cfg = make_config(indexer_topk=topk)
  idx = Indexer(cfg, rngs=nnx.Rngs(11))
  _randomize_norm(idx, seed=11)
  hf_cfg = hf_indexer_config(cfg, topk)
  hf_idx = DeepseekV32Indexer(hf_cfg, layer_idx=0).eval()
  copy_indexer_to_hf(idx, hf_idx)
  x, q_lat, pos = _inputs(cfg, b=2, t=t, seed=11)
  valid = attention_validity(pos, pos)

  ours = np.asarray(jax.jit(idx.__call__)(x, q_lat, pos, valid))
  mask_ours = jax.jit(idx.select)(jnp.asarray(ours))

  hx, hq, hpos = to_torch(x), to_torch(q_lat), torch.from_numpy(np.asarray(pos, np.int64))
  cos, sin = DeepseekV32RotaryEmbedding(hf_cfg)(hx, hpos)
  mask_add = torch.where(torch.from_numpy(np.array(valid)), 0.0, torch.finfo(torch.float32).min)
  with torch.no_grad():
    hf_top = hf_idx(hx, hq, (cos, sin), mask_add, hpos).numpy()  # [b,t,topk] indices
    hf_scores = _hf_index_scores(hf_idx, hx, hq, cos, sin, mask_add).numpy()

  v = np.asarray(valid)
  np.testing.assert_allclose(ours[v], hf_scores[v], rtol=1e-4, atol=1e-5)
  assert hf_top.shape == (2, t, topk)
  mask_ours = np.asarray(mask_ours)
  for bi in range(2):
    for ti in range(t):
      hf_set = {int(i) for i in hf_top[bi, ti] if v[bi, ti, i]}  # HF fills short rows with masked keys
      assert hf_set == set(np.flatnonzero(mask_ours[bi, ti]).tolist()), (bi, ti)
  assert (mask_ours.sum(-1)[:, topk:] == topk).all()  # the selection really prunes beyond k keys
