"""MLA: the whole layer against a float64 numpy oracle, sparse-vs-dense invariants, segments
and padding, the indexer training stages and their gradient separation, and parity with
Hugging Face's DeepseekV32Attention."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config
from flax import nnx

from MaxText.kernels import selection
from MaxText.kernels.index_scores import indexer_kl_loss
from MaxText.kernels.masks import attention_validity
from MaxText.layers.attention_mla import MLA, capture_selection
from MaxText.layers.embeddings import rope_inv_freq

MAIN = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
T = 12  # one sequence length for most tests: compiled programs are shared


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x, pos, seg):
  (out, aux), inter = capture_selection(nnx.merge(graphdef, state), x, pos, seg)
  return out, aux, inter


def run(m: MLA, x, pos, seg=None):
  """Jitted m(x, pos, seg) -> (out, aux, the indexer_mask it sowed or None)."""
  out, aux, inter = _forward(*nnx.split(m), x, pos, seg)
  sown = inter["indexer_mask"][0] if "indexer_mask" in inter else None
  return out, aux, sown


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _make(seed=0, **overrides):
  cfg = make_config(**overrides)
  m = MLA(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 100)
  # non-trivial norm scales, and weights large enough that attention is far from uniform
  if cfg.q_lora_rank:
    m.q_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.q_lora_rank), jnp.float32)
  m.kv_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.kv_lora_rank), jnp.float32)
  for name in MAIN + ("wq",):
    if not hasattr(m, name):
      continue
    lin = getattr(m, name)
    lin.kernel[...] = jnp.asarray(rng.standard_normal(lin.kernel.shape) / math.sqrt(lin.kernel.shape[0]), jnp.float32)
  if m.indexer is not None:
    m.indexer.k_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.indexer_head_dim), jnp.float32)
    m.indexer.k_norm.bias[...] = jnp.asarray(0.3 * rng.standard_normal(cfg.indexer_head_dim), jnp.float32)
  return cfg, m


def _copy_main(src: MLA, dst: MLA):
  for name in MAIN:
    getattr(dst, name).kernel[...] = getattr(src, name).kernel[...]
  dst.q_norm.scale[...] = src.q_norm.scale[...]
  dst.kv_norm.scale[...] = src.kv_norm.scale[...]


def _inputs(cfg, b=2, t=T, seed=0, offset=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.emb_dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + offset, (b, t))
  return x, pos


def _np_rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def _np_rope_interleaved(x, positions, inv_freq):  # x [b,t,...,r]
  ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)  # [b,t,r/2]
  ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
  x1, x2 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = x1 * np.cos(ang) - x2 * np.sin(ang)
  out[..., 1::2] = x2 * np.cos(ang) + x1 * np.sin(ang)
  return out


def np_mla(m: MLA, x, positions, mask, with_probs=False):
  """float64 oracle of the whole layer under a boolean mask [b,t,s] -> out [b,t,D]
  (and the attention probabilities [b,h,t,s] with_probs)."""
  cfg = m.config
  w = {n: np.asarray(getattr(m, n).kernel[...], np.float64) for n in MAIN + ("wq",) if hasattr(m, n)}
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, nope, r, dv, c = cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  eps = 1e-6  # q_norm, kv_norm: DeepSeek's fixed eps, whatever normalization_layer_epsilon says
  inv = rope_inv_freq(cfg, r)
  q = x @ w["wq"] if "wq" in w else _np_rms(x @ w["wq_a"], m.q_norm.scale[...], eps) @ w["wq_b"]
  q = q.reshape(b, t, h, nope + r)
  q_nope, q_pe = q[..., :nope], _np_rope_interleaved(q[..., nope:], positions, inv)
  kv = x @ w["wkv_a"]
  c_kv, k_pe = _np_rms(kv[..., :c], m.kv_norm.scale[...], eps), _np_rope_interleaved(kv[..., c:], positions, inv)
  kvb = (c_kv @ w["wkv_b"]).reshape(b, t, h, nope + dv)
  k_nope, v = kvb[..., :nope], kvb[..., nope:]
  scale = (nope + r) ** -0.5
  if cfg.rope_type == "yarn" and cfg.rope_factor > 1:
    scale *= (0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0) ** 2
  logits = (np.einsum("bthd,bshd->bhts", q_nope, k_nope) + np.einsum("bthr,bsr->bhts", q_pe, k_pe)) * scale
  mask = np.asarray(mask)[:, None]
  logits = np.where(mask, logits, -np.inf)
  mx = np.max(np.where(mask, logits, -1e300), -1, keepdims=True)
  e = np.where(mask, np.exp(logits - mx), 0.0)
  probs = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  out = np.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, h * dv)  # [b,t,h*v]
  return (out @ w["wo"], probs) if with_probs else out @ w["wo"]


def np_index_scores(m: MLA, x, positions, valid):
  """float64 oracle of the layer's indexer scores I [b,t,s] (-inf where not valid). The optional
  Hadamard rotation is orthogonal, so q . k, and the oracle, do without it."""
  from test_indexer import _np_index_scores, _np_layernorm, _np_rope_half
  cfg, idx = m.config, m.indexer
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  r, inv = cfg.qk_rope_head_dim, rope_inv_freq(cfg, cfg.qk_rope_head_dim)
  kernel = lambda lin: np.asarray(lin.kernel[...], np.float64)
  q_lat = _np_rms(x @ kernel(m.wq_a), m.q_norm.scale[...], 1e-6)  # [b,t,q_lora]
  q = (q_lat @ kernel(idx.wq_b)).reshape(b, t, cfg.indexer_n_heads, cfg.indexer_head_dim)  # [b,t,H,d]
  k = _np_layernorm(x @ kernel(idx.wk), idx.k_norm.scale[...], idx.k_norm.bias[...])  # [b,s,d]
  q = np.concatenate([_np_rope_half(q[..., :r], positions, inv), q[..., r:]], -1)
  k = np.concatenate([_np_rope_half(k[..., :r], positions, inv), k[..., r:]], -1)
  w = x @ kernel(idx.weights_proj) * cfg.indexer_n_heads ** -0.5  # [b,t,H]
  return _np_index_scores(q, w, k, valid)


def np_topk_mask(scores, k):
  """bool [b,t,s]: each row's min(k, #finite) highest scores, ties lowest position first (lax.top_k's set)."""
  order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]  # [b,t,k]
  mask = np.zeros(scores.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask & np.isfinite(scores)


# ---------------------------------------------------------------- forward vs the oracle

def test_dense_mla_matches_float64_oracle():
  cfg, m = _make(0, use_indexer=False)
  x, pos = _inputs(cfg, offset=3)
  out, aux, sown = run(m, x, pos)
  assert out.shape == x.shape and float(aux["indexer_loss"]) == 0.0 and sown is None
  want = np_mla(m, x, pos, attention_validity(pos, pos))
  assert _rel(out, want) <= 1e-5


def test_latent_norms_keep_eps_1e6_whatever_normalization_layer_epsilon():
  # DeepSeek's MLA and HF's DeepseekV32Attention build q_norm and kv_norm as RMSNorm(dim): eps 1e-6.
  cfg, m = _make(0, use_indexer=False, normalization_layer_epsilon=0.5)
  x, pos = _inputs(cfg, offset=3)
  out, _, _ = run(m, x, pos)
  assert _rel(out, np_mla(m, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_mla_without_query_lora_matches_oracle():
  cfg, m = _make(11, use_indexer=False, q_lora_rank=0, rope_type="default")
  assert not hasattr(m, "wq_a") and m.wq.kernel.get_metadata()["logical_axes"] == ("embed", "q_heads")
  x, pos = _inputs(cfg, seed=11)
  out, _, _ = run(m, x, pos)
  assert _rel(out, np_mla(m, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_topk_at_least_seq_is_exactly_dense():
  cfg, sparse = _make(1, indexer_topk=T)
  _, dense = _make(2, use_indexer=False)
  _copy_main(sparse, dense)
  x, pos = _inputs(cfg, seed=1)
  out_s, _, sown = run(sparse, x, pos)
  out_d, _, _ = run(dense, x, pos)
  np.testing.assert_array_equal(np.asarray(sown), np.asarray(attention_validity(pos, pos)))
  np.testing.assert_array_equal(np.asarray(out_s), np.asarray(out_d))
  assert _rel(out_s, np_mla(sparse, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_sparse_mla_matches_oracle_with_reference_topk_mask():
  k = 4
  cfg, m = _make(3, indexer_topk=k)
  x, pos = _inputs(cfg, seed=3)
  valid = attention_validity(pos, pos)
  out, _, sown = run(m, x, pos)

  scores = jax.jit(lambda x: m.indexer(x, m.project_q(x, pos)[2], pos, valid))(x)
  ref = np.asarray(selection.generate_mask_reference(jax.lax.top_k(scores, k)[1], T)) & np.asarray(valid)
  np.testing.assert_array_equal(np.asarray(sown), ref)
  assert (ref.sum(-1)[:, k:] == k).all() and (ref.sum(-1)[:, :k] == np.arange(1, k + 1)).all()
  want = np_mla(m, x, pos, ref)
  assert _rel(out, want) <= 1e-5
  dense_want = np_mla(m, x, pos, valid)
  # rows with <= k visible keys equal dense causal attention; later rows really differ
  assert _rel(np.asarray(out)[:, :k], dense_want[:, :k]) <= 1e-5
  assert _rel(out, dense_want) > 1e-2


# ---------------------------------------------------------------- segments and padding

def test_segments_and_padding_give_no_nan_and_no_cross_segment_attention():
  cfg, m = _make(4, indexer_topk=3, indexer_training_stage="sparse")
  x, _ = _inputs(cfg, seed=4)
  seg = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]], jnp.int32)
  pos = jnp.asarray([list(range(5)) + list(range(5)) + [0, 0], list(range(9)) + [0, 0, 0]], jnp.int32)
  out, aux, sel = run(m, x, pos, seg)
  out, sel = np.asarray(out), np.asarray(sel)
  assert np.isfinite(out).all() and np.isfinite(float(aux["indexer_loss"])) and float(aux["indexer_loss"]) > 0
  np.testing.assert_array_equal(out[0, 10:], 0.0)  # padding queries attend to nothing
  assert not sel[0, 5:, :5].any() and not sel[0, :5, 5:].any() and not sel[:, :, 10:].any()
  assert (sel[0, 5:10].sum(-1) == [1, 2, 3, 3, 3]).all()  # segment 2 restarts its positions

  # perturbing segment 1 changes nothing in segment 2 (and does change segment 1)
  out2 = np.asarray(run(m, x.at[0, :5].add(1.0), pos, seg)[0])
  np.testing.assert_allclose(out2[0, 5:], out[0, 5:], rtol=0, atol=1e-6)
  assert np.abs(out2[0, :5] - out[0, :5]).max() > 1e-3
  # gradients through padded rows stay finite
  graphdef, state = nnx.split(m)

  def loss(x):
    out, aux, _ = _forward(graphdef, state, x, pos, seg)
    return jnp.sum(out) + aux["indexer_loss"]

  assert np.isfinite(np.asarray(jax.jit(jax.grad(loss))(x))).all()


def test_attention_validity_is_causal_by_original_positions():
  q_pos = jnp.asarray([[3, 0, 2]])  # a permuted (context-parallel reordered) sequence
  k_pos = jnp.asarray([[2, 3, 0, 1]])
  v = np.asarray(attention_validity(q_pos, k_pos))
  np.testing.assert_array_equal(v[0], np.asarray(k_pos)[0][None, :] <= np.asarray(q_pos)[0][:, None])
  seg_q, seg_k = jnp.asarray([[1, 2, 0]]), jnp.asarray([[1, 1, 2, 0]])
  vs = np.asarray(attention_validity(q_pos, k_pos, seg_q, seg_k))
  np.testing.assert_array_equal(vs[0], [[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
  with pytest.raises(ValueError, match="both"):
    attention_validity(q_pos, k_pos, seg_q, None)


# ---------------------------------------------------------------- indexer training stages

def test_dense_warmup_attends_densely_and_trains_indexer():
  cfg, warm = _make(5, indexer_topk=3, indexer_training_stage="dense_warmup")
  _, dense = _make(6, use_indexer=False)
  _copy_main(warm, dense)
  x, pos = _inputs(cfg, seed=5)
  out_w, aux, sel = run(warm, x, pos)
  assert (np.asarray(sel).sum(-1)[:, 3:] == 3).all()  # the selection exists but the attention ignores it
  np.testing.assert_allclose(np.asarray(out_w), np.asarray(run(dense, x, pos)[0]), rtol=0, atol=1e-6)
  assert _rel(out_w, np_mla(warm, x, pos, attention_validity(pos, pos))) <= 1e-5
  assert float(aux["indexer_loss"]) > 1e-3


@pytest.mark.parametrize("stage", ["dense_warmup", "none"])
def test_captured_layer_sows_the_indexers_recall_of_dense_attention(stage):
  cfg, m = _make(5, indexer_topk=3, indexer_training_stage=stage)
  x, pos = _inputs(cfg, seed=5)
  _, _, inter = _forward(*nnx.split(m), x, pos, None)
  sel = np.asarray(inter["indexer_mask"][0])
  _, probs = np_mla(m, x, pos, attention_validity(pos, pos), with_probs=True)  # float64 dense [b,h,t,s]
  p = probs.sum(1)  # [b,t,s]
  want = (p * sel).sum(-1) / p.sum(-1)  # [b,t]: the share of the DENSE mass on the selection, either stage
  np.testing.assert_allclose(np.asarray(inter["indexer_recall"][0]), want, rtol=1e-5)
  assert (want[:, :3] == 1).all() and (want[:, 3:] < 0.999).all()  # <= k keys: all selected; then not


def _np_kl(probs, scores, support):
  p = np.asarray(probs, np.float64).sum(1)
  p = np.where(support, p, 0)
  p = p / p.sum(-1, keepdims=True)
  s = np.where(support, np.asarray(scores, np.float64), -np.inf)
  logq = s - s.max(-1, keepdims=True)
  logq = logq - np.log(np.exp(logq).sum(-1, keepdims=True))
  kl = np.where(support & (p > 0), p * (np.log(np.where(p > 0, p, 1)) - np.where(support, logq, 0)), 0).sum(-1)
  return kl.mean()


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_kl_loss_value_and_zero_when_indexer_matches_attention(stage):
  cfg, m = _make(7, indexer_topk=3, indexer_training_stage=stage)
  x, pos = _inputs(cfg, seed=7)
  valid = attention_validity(pos, pos)

  @jax.jit
  def parts(x):  # the layer's steps, by its methods
    q_nope, q_pe, q_lat = m.project_q(x, pos)
    c_kv, k_pe = m.project_kv(x, pos)
    k_nope, v = m.expand_kv(c_kv)
    scores = m.indexer(x, q_lat, pos, valid)
    support = valid if stage == "dense_warmup" else m.indexer.select(scores) & valid
    return scores, support, m.attend(q_nope, q_pe, k_nope, k_pe, v, support)[1]

  scores, support, probs = parts(x)

  loss = float(indexer_kl_loss(probs, scores, support))
  np.testing.assert_allclose(loss, _np_kl(probs, scores, np.asarray(support)), rtol=1e-4)
  assert loss > 1e-3
  np.testing.assert_allclose(loss, float(run(m, x, pos)[1]["indexer_loss"]), rtol=1e-5)
  # I_t = log p_t (+ any per-row constant) on the support: KL = 0
  p = jnp.sum(probs, axis=1)
  matched = jnp.where(support, jnp.log(jnp.maximum(p, 1e-30)) + 3.0, -jnp.inf)
  assert abs(float(indexer_kl_loss(probs, matched, support))) < 1e-5


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_loss_and_attention_output_have_separate_gradients(stage):
  cfg, m = _make(8, indexer_topk=3, indexer_training_stage=stage)
  x, pos = _inputs(cfg, seed=8)
  r = jnp.asarray(np.random.default_rng(8).standard_normal(x.shape), jnp.float32)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  @jax.jit
  def grads(params):
    def run_(p):
      return nnx.merge(graphdef, p, rest)(x, pos)
    return (jax.grad(lambda p: run_(p)[1]["indexer_loss"])(params),
            jax.grad(lambda p: jnp.sum(run_(p)[0] * r))(params))

  def by_name(g):
    return {"/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(g)}

  gl, go = (by_name(g) for g in grads(params))
  main = [n for n in gl if not n.startswith("indexer/")]
  idx = [n for n in gl if n.startswith("indexer/")]
  assert {"wq_a/kernel", "wkv_a/kernel", "wo/kernel", "q_norm/scale"} <= set(main) and len(idx) == 5
  for n in main:
    assert np.all(gl[n] == 0), f"indexer_loss sends gradient into the main model's {n}"
    assert np.abs(go[n]).max() > 0, f"the output sends no gradient to {n}"
  for n in idx:
    assert np.all(go[n] == 0), f"the attention output sends gradient into {n}"
  for n in ("indexer/wq_b/kernel", "indexer/wk/kernel", "indexer/weights_proj/kernel", "indexer/k_norm/bias"):
    assert np.abs(gl[n]).max() > 0, f"indexer_loss does not train {n}"


def test_stage_none_has_zero_indexer_loss_and_attends_over_selection():
  cfg, m = _make(9, indexer_topk=3, indexer_training_stage="none")
  x, pos = _inputs(cfg, seed=9)
  out, aux, sel = run(m, x, pos)
  assert float(aux["indexer_loss"]) == 0.0
  assert _rel(out, np_mla(m, x, pos, np.asarray(sel))) <= 1e-5


# ---------------------------------------------------------------- Hugging Face parity

@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_mla_matches_hf_deepseek_v32_attention():
  torch = pytest.importorskip("torch")
  from test_indexer import _hf_config, _t, copy_indexer_to_hf
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding
  topk, t = 6, 20
  # 16 indexer heads make an all-relu-zero (tied) score rare; chunks of 6 exercise the padded head scan
  cfg, m = _make(10, indexer_topk=topk, indexer_n_heads=16, indexer_head_chunk=6)
  hf_cfg = _hf_config(cfg, topk)
  hf = DeepseekV32Attention(hf_cfg, layer_idx=0).eval()
  with torch.no_grad():
    hf.q_a_proj.weight.copy_(_t(m.wq_a.kernel[...]).T)
    hf.q_a_layernorm.weight.copy_(_t(m.q_norm.scale[...]))
    hf.q_b_proj.weight.copy_(_t(m.wq_b.kernel[...]).T)
    hf.kv_a_proj_with_mqa.weight.copy_(_t(m.wkv_a.kernel[...]).T)
    hf.kv_a_layernorm.weight.copy_(_t(m.kv_norm.scale[...]))
    hf.kv_b_proj.weight.copy_(_t(m.wkv_b.kernel[...]).T)
    hf.o_proj.weight.copy_(_t(m.wo.kernel[...]).T)
  copy_indexer_to_hf(m.indexer, hf.indexer)
  x, pos = _inputs(cfg, t=t, seed=10)
  valid = attention_validity(pos, pos)
  out, _, _ = run(m, x, pos)
  # relu makes exact ties (often at 0) common; HF's torch.topk breaks them differently from
  # lax.top_k (lowest position first), so check that these inputs have none at the k-th value
  scores = jax.jit(lambda x: m.indexer(x, m.project_q(x, pos)[2], pos, valid))(x)
  s = np.sort(np.asarray(scores), -1)[..., ::-1]  # [b,t,s] descending
  assert (s[:, topk:, topk - 1] > s[:, topk:, topk]).all(), "tied k-th score: pick another seed"

  hx, hpos = _t(x), torch.from_numpy(np.array(pos, np.int64))
  cos, sin = DeepseekV32RotaryEmbedding(hf_cfg)(hx, hpos)
  mask = torch.where(torch.from_numpy(np.array(valid)), 0.0, torch.finfo(torch.float32).min)[:, None]  # [b,1,t,s]
  with torch.no_grad():
    hf_out, _ = hf(hx, (cos, sin), mask, position_ids=hpos)
  assert _rel(out, hf_out.numpy()) <= 1e-4
  assert _rel(out, np_mla(m, x, pos, valid)) > 1e-2  # the selection matters on this sequence
  assert hf.scaling == pytest.approx(cfg.softmax_scale, rel=1e-12)


def test_params_carry_logical_axes():
  cfg, m = _make(12)
  want = {"wq_a": ("embed", "q_lora"), "wq_b": ("q_lora", "q_heads"), "wkv_a": ("embed", "kv_lora"),
          "wkv_b": ("kv_lora", "kv_heads"), "wo": ("q_heads", "embed"),
          "indexer/wq_b": ("q_lora", "q_heads"), "indexer/wk": ("embed", "head_dim"),
          "indexer/weights_proj": ("embed", "q_heads")}
  for name, axes in want.items():
    lin = m
    for part in name.split("/"):
      lin = getattr(lin, part)
    assert lin.kernel.get_metadata()["logical_axes"] == axes, name
  h, qk = cfg.num_query_heads, cfg.qk_head_dim
  assert m.wq_b.kernel.shape == (cfg.q_lora_rank, h * qk)
  assert m.wkv_a.kernel.shape == (cfg.emb_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  assert m.wkv_b.kernel.shape == (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
  assert m.indexer.wq_b.kernel.shape == (cfg.q_lora_rank, cfg.indexer_n_heads * cfg.indexer_head_dim)
