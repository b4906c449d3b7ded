"""MLA: the whole layer against a float64 numpy oracle, sparse-vs-dense invariants, segments
and padding, the indexer training stages and their gradient separation, and parity with
Hugging Face's DeepseekV32Attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import selection
from MaxText.kernels.index_scores import indexer_kl_loss
from MaxText.kernels.masks import attention_validity
from MaxText.layers.attention_mla import MLA, capture_selection
from tests.support.attention_reference import (
  MAIN,
  T,
  copy_indexer_to_hf,
  hf_indexer_config,
  make_mla,
  mla_inputs,
  np_kl,
  np_mla,
  rel_err,
  to_torch,
)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x, pos, seg):
  (out, aux), inter = capture_selection(nnx.merge(graphdef, state), x, pos, seg)
  return out, aux, inter


def run(m: MLA, x, pos, seg=None):
  """Jitted m(x, pos, seg) -> (out, aux, the indexer_mask it sowed or None)."""
  out, aux, inter = _forward(*nnx.split(m), x, pos, seg)
  sown = inter["indexer_mask"][0] if "indexer_mask" in inter else None
  return out, aux, sown


def _copy_main(src: MLA, dst: MLA):
  for name in MAIN:
    getattr(dst, name).kernel[...] = getattr(src, name).kernel[...]
  dst.q_norm.scale[...] = src.q_norm.scale[...]
  dst.kv_norm.scale[...] = src.kv_norm.scale[...]


# ---------------------------------------------------------------- forward vs the oracle

def test_dense_mla_matches_float64_oracle():
  cfg, m = make_mla(0, use_indexer=False)
  x, pos = mla_inputs(cfg, offset=3)
  out, aux, sown = run(m, x, pos)
  assert out.shape == x.shape and float(aux["indexer_loss"]) == 0.0 and sown is None
  want = np_mla(m, x, pos, attention_validity(pos, pos))
  assert rel_err(out, want) <= 1e-5


def test_latent_norms_keep_eps_1e6_whatever_normalization_layer_epsilon():
  # DeepSeek's MLA and HF's DeepseekV32Attention build q_norm and kv_norm as RMSNorm(dim): eps 1e-6.
  cfg, m = make_mla(0, use_indexer=False, normalization_layer_epsilon=0.5)
  x, pos = mla_inputs(cfg, offset=3)
  out, _, _ = run(m, x, pos)
  assert rel_err(out, np_mla(m, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_mla_without_query_lora_matches_oracle():
  cfg, m = make_mla(11, use_indexer=False, q_lora_rank=0, rope_type="default")
  assert not hasattr(m, "wq_a") and m.wq.kernel.get_metadata()["logical_axes"] == ("embed", "q_heads")
  x, pos = mla_inputs(cfg, seed=11)
  out, _, _ = run(m, x, pos)
  assert rel_err(out, np_mla(m, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_topk_at_least_seq_is_exactly_dense():
  cfg, sparse = make_mla(1, indexer_topk=T)
  _, dense = make_mla(2, use_indexer=False)
  _copy_main(sparse, dense)
  x, pos = mla_inputs(cfg, seed=1)
  out_s, _, sown = run(sparse, x, pos)
  out_d, _, _ = run(dense, x, pos)
  np.testing.assert_array_equal(np.asarray(sown), np.asarray(attention_validity(pos, pos)))
  np.testing.assert_array_equal(np.asarray(out_s), np.asarray(out_d))
  assert rel_err(out_s, np_mla(sparse, x, pos, attention_validity(pos, pos))) <= 1e-5


def test_sparse_mla_matches_oracle_with_reference_topk_mask():
  k = 4
  cfg, m = make_mla(3, indexer_topk=k)
  x, pos = mla_inputs(cfg, seed=3)
  valid = attention_validity(pos, pos)
  out, _, sown = run(m, x, pos)

  scores = jax.jit(lambda x: m.indexer(x, m.project_q(x, pos)[2], pos, valid))(x)
  ref = np.asarray(selection.generate_mask_reference(jax.lax.top_k(scores, k)[1], T)) & np.asarray(valid)
  np.testing.assert_array_equal(np.asarray(sown), ref)
  assert (ref.sum(-1)[:, k:] == k).all() and (ref.sum(-1)[:, :k] == np.arange(1, k + 1)).all()
  want = np_mla(m, x, pos, ref)
  assert rel_err(out, want) <= 1e-5
  dense_want = np_mla(m, x, pos, valid)
  # rows with <= k visible keys equal dense causal attention; later rows really differ
  assert rel_err(np.asarray(out)[:, :k], dense_want[:, :k]) <= 1e-5
  assert rel_err(out, dense_want) > 1e-2


# ---------------------------------------------------------------- segments and padding

def test_segments_and_padding_give_no_nan_and_no_cross_segment_attention():
  cfg, m = make_mla(4, indexer_topk=3, indexer_training_stage="sparse")
  x, _ = mla_inputs(cfg, seed=4)
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
  cfg, warm = make_mla(5, indexer_topk=3, indexer_training_stage="dense_warmup")
  _, dense = make_mla(6, use_indexer=False)
  _copy_main(warm, dense)
  x, pos = mla_inputs(cfg, seed=5)
  out_w, aux, sel = run(warm, x, pos)
  assert (np.asarray(sel).sum(-1)[:, 3:] == 3).all()  # the selection exists but the attention ignores it
  np.testing.assert_allclose(np.asarray(out_w), np.asarray(run(dense, x, pos)[0]), rtol=0, atol=1e-6)
  assert rel_err(out_w, np_mla(warm, x, pos, attention_validity(pos, pos))) <= 1e-5
  assert float(aux["indexer_loss"]) > 1e-3


@pytest.mark.parametrize("stage", ["dense_warmup", "none"])
def test_captured_layer_sows_the_indexers_recall_of_dense_attention(stage):
  cfg, m = make_mla(5, indexer_topk=3, indexer_training_stage=stage)
  x, pos = mla_inputs(cfg, seed=5)
  _, _, inter = _forward(*nnx.split(m), x, pos, None)
  sel = np.asarray(inter["indexer_mask"][0])
  _, probs = np_mla(m, x, pos, attention_validity(pos, pos), with_probs=True)  # float64 dense [b,h,t,s]
  p = probs.sum(1)  # [b,t,s]
  want = (p * sel).sum(-1) / p.sum(-1)  # [b,t]: the share of the DENSE mass on the selection, either stage
  np.testing.assert_allclose(np.asarray(inter["indexer_recall"][0]), want, rtol=1e-5)
  assert (want[:, :3] == 1).all() and (want[:, 3:] < 0.999).all()  # <= k keys: all selected; then not


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_kl_loss_value_and_zero_when_indexer_matches_attention(stage):
  cfg, m = make_mla(7, indexer_topk=3, indexer_training_stage=stage)
  x, pos = mla_inputs(cfg, seed=7)
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
  np.testing.assert_allclose(loss, np_kl(probs, scores, np.asarray(support)), rtol=1e-4)
  assert loss > 1e-3
  np.testing.assert_allclose(loss, float(run(m, x, pos)[1]["indexer_loss"]), rtol=1e-5)
  # I_t = log p_t (+ any per-row constant) on the support: KL = 0
  p = jnp.sum(probs, axis=1)
  matched = jnp.where(support, jnp.log(jnp.maximum(p, 1e-30)) + 3.0, -jnp.inf)
  assert abs(float(indexer_kl_loss(probs, matched, support))) < 1e-5


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_loss_and_attention_output_have_separate_gradients(stage):
  cfg, m = make_mla(8, indexer_topk=3, indexer_training_stage=stage)
  x, pos = mla_inputs(cfg, seed=8)
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
  cfg, m = make_mla(9, indexer_topk=3, indexer_training_stage="none")
  x, pos = mla_inputs(cfg, seed=9)
  out, aux, sel = run(m, x, pos)
  assert float(aux["indexer_loss"]) == 0.0
  assert rel_err(out, np_mla(m, x, pos, np.asarray(sel))) <= 1e-5


# ---------------------------------------------------------------- Hugging Face parity

@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_mla_matches_hf_deepseek_v32_attention():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding
  topk, t = 6, 20
  # 16 indexer heads make an all-relu-zero (tied) score rare; chunks of 6 exercise the padded head scan
  cfg, m = make_mla(10, indexer_topk=topk, indexer_n_heads=16, indexer_head_chunk=6)
  hf_cfg = hf_indexer_config(cfg, topk)
  hf = DeepseekV32Attention(hf_cfg, layer_idx=0).eval()
  with torch.no_grad():
    hf.q_a_proj.weight.copy_(to_torch(m.wq_a.kernel[...]).T)
    hf.q_a_layernorm.weight.copy_(to_torch(m.q_norm.scale[...]))
    hf.q_b_proj.weight.copy_(to_torch(m.wq_b.kernel[...]).T)
    hf.kv_a_proj_with_mqa.weight.copy_(to_torch(m.wkv_a.kernel[...]).T)
    hf.kv_a_layernorm.weight.copy_(to_torch(m.kv_norm.scale[...]))
    hf.kv_b_proj.weight.copy_(to_torch(m.wkv_b.kernel[...]).T)
    hf.o_proj.weight.copy_(to_torch(m.wo.kernel[...]).T)
  copy_indexer_to_hf(m.indexer, hf.indexer)
  x, pos = mla_inputs(cfg, t=t, seed=10)
  valid = attention_validity(pos, pos)
  out, _, _ = run(m, x, pos)
  # relu makes exact ties (often at 0) common; HF's torch.topk breaks them differently from
  # lax.top_k (lowest position first), so check that these inputs have none at the k-th value
  scores = jax.jit(lambda x: m.indexer(x, m.project_q(x, pos)[2], pos, valid))(x)
  s = np.sort(np.asarray(scores), -1)[..., ::-1]  # [b,t,s] descending
  assert (s[:, topk:, topk - 1] > s[:, topk:, topk]).all(), "tied k-th score: pick another seed"

  hx, hpos = to_torch(x), torch.from_numpy(np.array(pos, np.int64))
  cos, sin = DeepseekV32RotaryEmbedding(hf_cfg)(hx, hpos)
  mask = torch.where(torch.from_numpy(np.array(valid)), 0.0, torch.finfo(torch.float32).min)[:, None]  # [b,1,t,s]
  with torch.no_grad():
    hf_out, _ = hf(hx, (cos, sin), mask, position_ids=hpos)
  assert rel_err(out, hf_out.numpy()) <= 1e-4
  assert rel_err(out, np_mla(m, x, pos, valid)) > 1e-2  # the selection matters on this sequence
  assert hf.scaling == pytest.approx(cfg.softmax_scale, rel=1e-12)


def test_params_carry_logical_axes():
  cfg, m = make_mla(12)
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
