"""The indexer KL target's Pallas kernel (kernels/kl_target.py, interpret mode on the CPU) against the XLA
head_summed_probs: several query and key blocks (the causal skip), packed segments, padding queries and keys;
its Mosaic lowering at the real shapes. Through MLA.attend_flash (loss, gradients) it is covered by
test_flash_attention.py's splash-vs-XLA test, whose splash side now runs this kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import backend, flash_attention, kl_target
from MaxText.kernels.flash_attention import head_summed_probs
from MaxText.kernels.kl_target import head_summed_probs_kernel
from MaxText.kernels.masks import attention_validity
from tests.support.attention_reference import make_mla, mla_inputs

ATOL = 2e-6  # fp32: values in [0, h]; the kernel's exp(logit - lse) and XLA's softmax round differently (~2e-7 seen)


def _inputs(d, dtype, t=256, h=4, seed=0):
  """q, k [b,t,h,d]; row 0 two packed segments (160 | 96 tokens: at 128-key blocks the second's queries see no
  valid key in block 0, then some: the online rescale), row 1 one segment then 37 padding tokens."""
  rng = np.random.default_rng(seed)
  q, k = (jnp.asarray(rng.standard_normal((2, t, h, d)), dtype) for _ in range(2))
  seg = np.ones((2, t), np.int32)
  seg[0, 160:] = 2
  seg[1, t - 37:] = 0
  pos = np.concatenate([np.arange(160), np.arange(t - 160)])[None].repeat(2, 0)
  pos[1] = np.arange(t)
  valid = attention_validity(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg))  # [b,t,t]
  return q, k, jnp.asarray(seg), valid


@pytest.mark.parametrize("d,dtype,blocks", [
    (64, jnp.float32, (128, 128)),  # 2 x 2 blocks: the block above the diagonal skipped
    (64, jnp.float32, (128, 256)),  # a key block wider than a query block: the diagonal inside it
    (192, jnp.bfloat16, (256, 128)),  # MLA's joint qk width, bf16 inputs as in training; a query block of 2 key blocks
])
def test_kernel_equals_the_xla_head_summed_probs(d, dtype, blocks):
  q, k, seg, valid = _inputs(d, dtype)
  scale = d ** -0.5 * 1.5
  want = np.asarray(head_summed_probs(q, k, valid, scale))  # [b,t,t]
  got = np.asarray(head_summed_probs_kernel(q, k, seg, scale, query_block=blocks[0], key_block=blocks[1]))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  h = q.shape[2]
  assert np.all(got[1, -37:] == 0)  # padding queries: 0 rows, as the XLA path
  assert np.all(got[1, :, -37:] == 0) and np.all(got[0, 160:, :160] == 0)  # padding keys, the other segment: 0
  assert np.all(np.triu(got[0], 1) == 0)  # above the causal diagonal: 0
  np.testing.assert_allclose(got[0].sum(-1), h, rtol=1e-5)  # every real query: h distributions


def test_kernel_without_segments_is_causal_over_every_key():
  q, k, _, _ = _inputs(64, jnp.float32)
  q, k, t = q[:1], k[:1], q.shape[1]
  valid = jnp.tril(jnp.ones((1, t, t), bool))
  got = head_summed_probs_kernel(q, k, None, 0.2, query_block=128, key_block=128)
  np.testing.assert_allclose(np.asarray(got), np.asarray(head_summed_probs(q, k, valid, 0.2)), atol=ATOL, rtol=0)


def test_kernel_lowers_to_mosaic_at_the_real_shapes():
  """b 1, t 2048, h 128, d 192 bf16 (deepseek3.2-v5e's layer), exported for the TPU from the CPU: one Mosaic call."""
  qk = jax.ShapeDtypeStruct((1, 2048, 128, 192), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
  f = jax.jit(lambda q, k, s: head_summed_probs_kernel(q, k, s, 0.1, interpret=False))
  text = jax.export.export(f, platforms=["tpu"])(qk, qk, seg).mlir_module()
  assert text.count("tpu_custom_call") == 1 and "kl_target_head_summed_probs" in text


def test_layer_gradient_under_remat_lowers_with_the_kernel(monkeypatch):
  """MLA's sparse stage with top-k = t under mask_attention=splash, its parameters' gradient under jax.checkpoint
  lowered for the TPU from the CPU: the target's kernel is in it (forward, and recomputed) beside splash's calls."""
  for module in (kl_target, flash_attention):
    monkeypatch.setattr(module, "pallas_interpret", lambda interpret: False)  # Mosaic, not the interpreter
  cfg, m = make_mla(3, indexer_topk=128, indexer_training_stage="sparse")
  x, pos = mla_inputs(cfg, t=128, seed=3)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  def loss(p):
    out, aux = nnx.merge(graphdef, p, rest)(x, pos, jnp.ones(pos.shape, jnp.int32))
    return jnp.sum(out) + aux["indexer_loss"]

  with backend.forced(mask_attention="splash"):
    text = jax.jit(jax.grad(jax.checkpoint(loss))).trace(params).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("kl_target_head_summed_probs") >= 1 and text.count("tpu_custom_call") >= 4
