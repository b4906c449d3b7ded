"""MLA's mask path through the splash kernel (kernels/flash_attention.py, Pallas interpret mode on the CPU)
against the XLA mask path: outputs, the indexer KL loss and every parameter's gradient; and the dispatch
(MLA.use_flash): the kernel only where the support is the validity mask."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import backend
from MaxText.kernels.flash_attention import flash_attention, head_summed_probs
from MaxText.kernels.masks import attention_validity
from MaxText.runtime import sharding
from tests.support.attention_reference import make_mla, mla_inputs, rel_err

T_FLASH = 128  # splash's smallest block (128 lanes); tiny model dims otherwise
TOL = 2e-5  # fp32: the kernel's online softmax and the head-chunked KL target sum in another order


def _loss_and_grads(m, x, pos, seg, r, choice, mesh_cfg=None):
  """(out, indexer loss, grads of sum(out * r) + indexer loss per parameter) with mask_attention=choice; under
  mesh_cfg's mesh and rules when given."""
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  rules = sharding.logical_rules(mesh_cfg, sharding.create_mesh(mesh_cfg)) if mesh_cfg else contextlib.nullcontext()
  with backend.forced(mask_attention=choice), rules:
    def f(p):
      out, aux = nnx.merge(graphdef, p, rest)(x, pos, seg)
      return jnp.sum(out * r) + aux["indexer_loss"], (out, aux["indexer_loss"])
    (_, (out, il)), g = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return out, il, {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                   for path, v in jax.tree_util.tree_leaves_with_path(g)}


def _segments(b, t):
  seg = np.ones((b, t), np.int32)
  seg[0, t // 2:] = 2  # row 0: two packed sequences
  seg[1, t - 5:] = 0  # row 1: padding at the end
  pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0)
  pos[1] = np.arange(t)
  return jnp.asarray(seg), jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("stage,segments,mesh", [
    pytest.param("dense_warmup", False, None, marks=pytest.mark.slow), ("sparse", True, None),
    pytest.param("none", False, None, marks=pytest.mark.slow),
    pytest.param("sparse", True, dict(ici_data_parallelism=2, ici_tensor_parallelism=2), marks=pytest.mark.slow)])
def test_splash_equals_the_xla_mask_path_values_loss_and_gradients(stage, segments, mesh):
  """mesh: rows over data, heads over tensor (4 of the 8 host devices): splash per shard in a shard_map."""
  mesh_overrides = dict(num_devices=4, **mesh) if mesh else {}
  cfg, m = make_mla(3, indexer_topk=T_FLASH, indexer_training_stage=stage, **mesh_overrides)
  x, pos = mla_inputs(cfg, t=T_FLASH, seed=3)
  seg = None
  if segments:
    seg, pos = _segments(*pos.shape)
  with backend.forced(mask_attention="splash"):
    assert m.use_flash(T_FLASH)
  r = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.float32)
  mesh_cfg = cfg if mesh else None
  out_x, il_x, g_x = _loss_and_grads(m, x, pos, seg, r, "xla", mesh_cfg)
  out_s, il_s, g_s = _loss_and_grads(m, x, pos, seg, r, "splash", mesh_cfg)
  assert rel_err(out_s, out_x) < TOL
  if seg is not None:  # padding queries: 0 on both paths
    assert np.all(np.asarray(out_s)[1, -5:] == 0) and np.all(np.asarray(out_x)[1, -5:] == 0)
  if stage == "none":
    assert float(il_x) == 0 and float(il_s) == 0
  else:
    assert float(il_x) > 1e-3 and abs(float(il_s) - float(il_x)) < TOL * abs(float(il_x))
  assert set(g_s) == set(g_x) and len(g_x) >= 10
  for name in g_x:
    if np.abs(g_x[name]).max() == 0:
      assert np.abs(g_s[name]).max() == 0, name
    else:
      assert rel_err(g_s[name], g_x[name]) < TOL, name


def test_kernel_taken_only_where_the_support_is_every_valid_key():
  t = T_FLASH
  cases = {  # (overrides, t) -> whether the kernel may run
      "dense warm-up, top-k < t": (dict(indexer_topk=t // 2, indexer_training_stage="dense_warmup"), True),
      "sparse, top-k = t": (dict(indexer_topk=t, indexer_training_stage="sparse"), True),
      "sparse, top-k < t": (dict(indexer_topk=t - 1, indexer_training_stage="sparse"), False),
      "stage none, top-k < t": (dict(indexer_topk=t - 1, indexer_training_stage="none"), False),
      "sparse, approximate top-k = t": (dict(indexer_topk=t, indexer_use_approx_top_k=True), False),
      "no indexer": (dict(use_indexer=False), True),
  }
  for what, (overrides, want) in cases.items():
    _, m = make_mla(0, **overrides)
    with backend.forced(mask_attention="splash"):
      assert m.use_flash(t) is want, what
    with backend.forced(mask_attention="xla"):
      assert m.use_flash(t) is False, what
  _, m = make_mla(0, indexer_topk=t, indexer_training_stage="dense_warmup")
  m.record_selection = True  # capture_selection reads the probabilities
  with backend.forced(mask_attention="splash"):
    assert m.use_flash(t) is False
  # context parallelism: splash's causal mask is not its zig-zag order over [t/cp, s] blocks
  _, m_cp = make_mla(0, indexer_topk=t, num_devices=2, ici_context_parallelism=2)
  with backend.forced(mask_attention="splash"):
    assert m_cp.use_flash(t) is False
    assert m.use_flash(t + 64) is False  # not a multiple of splash's 128
  assert backend.row("cpu").mask_attention == "xla" and backend.row("gpu").mask_attention == "xla"


def test_head_summed_probs_in_head_chunks_equals_float64_softmax_sum():
  rng = np.random.default_rng(5)
  b, t, h, d, scale = 2, 12, 6, 8, 0.3
  q, k = (rng.standard_normal((b, t, h, d)).astype(np.float32) for _ in range(2))
  seg = np.array([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3], np.int32)
  pos = np.array([list(range(7)) + list(range(5)), list(range(12))], np.int32)
  valid = np.asarray(attention_validity(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg)))
  logits = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k.astype(np.float64)) * scale
  logits = np.where(valid[:, None], logits, -np.inf)
  with np.errstate(invalid="ignore"):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.nan_to_num((e / e.sum(-1, keepdims=True)).sum(1))  # [b,t,s]; a padding row: 0
  for chunk in (1, 2, 6):  # 3 chunks of 2 heads, and one chunk of all
    got = np.asarray(head_summed_probs(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), scale, head_chunk=chunk))
    np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"head_chunk={chunk}")
  assert np.all(got[1, 9:] == 0) and np.allclose(got[0, :, :].sum(-1), h)


def test_splash_lowers_to_mosaic_at_mla_head_dims():
  """The kernel compiled for the TPU (Mosaic custom calls: forward, dq, dkv) at qk 192 / v 128, from the CPU."""
  b, t, h = 1, 256, 2
  qk = jax.ShapeDtypeStruct((b, t, h, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((b, t, h, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def loss(q, k, v, seg):
    return jnp.sum(flash_attention(q, k, v, seg, 0.1, interpret=False).astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(qk, qk, v, seg).lower(
      lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 3
