"""A small LoRA adapter keeps its effect at the 671B's dtypes (bf16 compute over DeepSeek's fp8 blocks) in every
path of MLA's wkv_b: the training mask path (the Linear's forward), the training gather path (absorbed, >= 3072
tokens on the 671B) and the cached serving step (absorbed: RL rollouts, decode). Tiny dims.

The MLA-level tests take over 5 s of CPU (slow); the fast lane holds the pieces: the Linear's forward, and absorb_q /
unabsorb_out with the adapter's fp32 term. The mask path's figure is noisier (more bf16 roundings between wkv_b and the output: 0.63 to 1.05 over four
inputs at 0.07%), so its wkv_b is checked at the Linear itself.

`kept` is the share of the exact adapter effect (fp32 compute, highest precision, the same fp8 weights) that a
path's bf16 output change keeps, read as the projection <d, d_exact> / <d_exact, d_exact> over every output
element (rounding noise averages out; a systematic loss does not). Merged into a bf16 wkv_b (the code before
kernels/low_rank.py) an adapter of 0.2% of the weight kept ~0.4 in the absorbed paths; added to a bf16 x W, ~0.8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.inference import kv_cache
from MaxText.inference.cache_view import CacheView
from MaxText.kernels import low_rank
from MaxText.kernels.fp8_blocks import BlockFP8, dequantize, quantize
from MaxText.kernels.sparse_attention import absorb_q, unabsorb_out
from MaxText.layers import lora
from MaxText.layers.attention_mla import MLA
from tests.conftest import make_config

T = 64  # tokens a row; indexer_topk = T: the selection is every key in both dtypes (one function to compare)


def _mla(dtype: str, impl: str) -> MLA:
  cfg = make_config(dtype=dtype, weight_quantization="fp8_block", weight_block_size=(16, 16), lora_rank=4,
                    lora_module_path="wkv_b", indexer_topk=T, sparse_attention_impl=impl, max_target_length=T,
                    matmul_precision="highest" if dtype == "float32" else "default")
  mla = MLA(cfg, rngs=nnx.Rngs(0))
  lora.add_adapters(mla, cfg, nnx.Rngs(1))
  return mla


def _set_b(mla: MLA, rel: float) -> None:
  """B random, scaled so that (alpha / r) A B is `rel` of wkv_b's dequantized weight (Frobenius)."""
  lin = mla.wkv_b
  w = np.asarray(dequantize(BlockFP8(lin.kernel[...], lin.kernel_scale[...])), np.float64)
  b = np.asarray(jax.random.normal(jax.random.key(7), lin.lora_b.shape), np.float64)
  ab = lin.lora_scale * np.asarray(lin.lora_a[...], np.float64) @ b
  lin.lora_b[...] = jnp.asarray(b * rel * np.linalg.norm(w) / np.linalg.norm(ab), jnp.float32)


def _out(mla: MLA, path: str, x: jax.Array) -> np.ndarray:
  b = x.shape[0]
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
  if path == "cached":  # a prefill of T tokens into an empty contiguous cache: absorbed MLA, as a serving step
    view = CacheView(kv_cache.init_layer_cache(mla.config, b), None, mode="sparse")
    return np.asarray(mla.attend_cached(x.astype(mla.dtype), positions, view)[0], np.float64)
  return np.asarray(mla(x.astype(mla.dtype), positions)[0], np.float64)


def _kept(path: str, rel: float) -> float:
  impl = "gather" if path == "gather" else "mask"
  x = jax.random.normal(jax.random.key(3), (2, T, 64))
  d = {}
  for dtype in ("bfloat16", "float32"):
    mla = _mla(dtype, impl)
    base = _out(mla, path, x)
    _set_b(mla, rel)
    d[dtype] = _out(mla, path, x) - base
  exact = d["float32"]
  return float(np.sum(d["bfloat16"] * exact) / np.sum(exact * exact))


@pytest.mark.slow  # over 5 s of CPU (two MLAs, four forwards); the fast lane checks the pieces below
@pytest.mark.parametrize("path", ["gather", "cached"])
def test_a_small_adapter_on_an_fp8_wkv_b_keeps_its_effect_in_the_absorbed_paths_in_bf16(path):
  kept = _kept(path, 2e-3)
  assert 0.9 < kept < 1.1, f"{path}: a 0.2% adapter kept {kept:.3f} of its effect"


def test_a_small_adapter_keeps_its_effect_through_a_bf16_linear_over_fp8_blocks():
  """The Linear's own forward (the mask path's wkv_b, and every other adapted linear): x W and x A B summed in fp32,
  rounded once. Added to an x W already rounded to bf16, a 0.07% adapter kept 0.44 of its effect."""
  mla = _mla("bfloat16", "mask")
  lin = mla.wkv_b
  x = jax.random.normal(jax.random.key(3), (2, 512, lin.kernel.shape[0])).astype(jnp.bfloat16)  # [b,t,c]
  base = np.asarray(lin(x), np.float64)
  _set_b(mla, 7e-4)
  w = np.asarray(dequantize(BlockFP8(lin.kernel[...], lin.kernel_scale[...])), np.float64)
  ab = lin.lora_scale * np.asarray(lin.lora_a[...], np.float64) @ np.asarray(lin.lora_b[...], np.float64)
  exact = np.asarray(x, np.float64) @ ab  # [b,t,out]: the adapter's exact effect
  d = np.asarray(lin(x), np.float64) - base
  kept = float(np.sum(d * exact) / np.sum(exact * exact))
  assert 0.95 < kept < 1.05, f"a 0.07% adapter kept {kept:.3f} of its effect"
  assert np.abs(np.asarray(x, np.float64) @ w + exact - np.asarray(lin(x), np.float64)).max() < 0.01 * np.abs(base).max()


def _share(d: np.ndarray, exact: np.ndarray) -> float:
  return float(np.sum(d * exact) / np.sum(exact * exact))


def _absorbed_shares(rel: float) -> tuple[float, float, float]:
  """(absorb_q's, unabsorb_out's share of an exact `rel` wkv_b adapter with it apart, absorb_q's with it merged into
  the bf16 kernel): bf16 inputs, an fp8 wkv_b [c, h*(nope+v)] in 16 x 16 blocks."""
  h, nope, v, c, r = 4, 16, 16, 32, 4
  w = quantize(jax.random.normal(jax.random.key(0), (c, h * (nope + v))) * 0.05, (16, 16))
  w_bf16 = dequantize(w, jnp.bfloat16)
  a = np.asarray(jax.random.normal(jax.random.key(1), (c, r)), np.float64)
  b = np.asarray(jax.random.normal(jax.random.key(2), (r, h * (nope + v))), np.float64)
  b *= rel * np.linalg.norm(np.asarray(dequantize(w), np.float64)) / np.linalg.norm(a @ b)
  lr = low_rank.LowRank(jnp.asarray(a[None], jnp.float32), jnp.asarray(b[None], jnp.float32))
  ab = (a @ b).reshape(c, h, nope + v)  # the adapter's update [c,h,nope+v]
  q = jax.random.normal(jax.random.key(3), (2, 64, h, nope)).astype(jnp.bfloat16)  # q_nope [b,t,h,nope]
  o = jax.random.normal(jax.random.key(4), (2, 64, h, c)).astype(jnp.bfloat16)  # o_lat [b,t,h,c]
  f64 = lambda z: np.asarray(z, np.float64)  # noqa: E731
  base_q, base_o = f64(absorb_q(q, w_bf16, h, nope, v)), f64(unabsorb_out(o, w_bf16, h, nope, v))
  got_q = absorb_q(q, w_bf16, h, nope, v, delta=low_rank.absorbed_q_delta(q, lr, nope, jnp.bfloat16))
  got_o = unabsorb_out(o, w_bf16, h, nope, v, delta=low_rank.absorbed_out_delta(o, lr, nope, jnp.bfloat16))
  assert got_q.dtype == got_o.dtype == jnp.bfloat16
  exact_q = np.einsum("bthd,chd->bthc", f64(q), ab[..., :nope])  # [b,t,h,c]
  exact_o = np.einsum("bthc,chv->bthv", f64(o), ab[..., nope:])  # [b,t,h,v]
  merged = (w_bf16.astype(jnp.float32) + jnp.asarray(a @ b, jnp.float32)).astype(jnp.bfloat16)  # kernel_value before
  return (_share(f64(got_q) - base_q, exact_q), _share(f64(got_o) - base_o, exact_o),
          _share(f64(absorb_q(q, merged, h, nope, v)) - base_q, exact_q))


def test_absorb_q_and_unabsorb_out_keep_a_small_wkv_b_adapter_in_bf16():
  """The absorbed paths' two contractions with wkv_b's adapter apart (low_rank.absorbed_q_delta / absorbed_out_delta
  added to the fp32 product, rounded once) keep a 0.2% adapter's effect (1.01, 1.00); merged into the bf16 kernel
  (kernel_value before) a 0.07% adapter kept less than half of it."""
  q_share, o_share, _ = _absorbed_shares(2e-3)
  assert 0.95 < q_share < 1.05 and 0.95 < o_share < 1.05, (q_share, o_share)
  merged_share = _absorbed_shares(7e-4)[2]
  assert merged_share < 0.5, merged_share
