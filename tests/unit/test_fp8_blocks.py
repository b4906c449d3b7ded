"""fp8 block-quantized weights (kernels/fp8_blocks.py and the layers that hold them): the per-block scale math
against a loop-per-block reference, the grouped matmul on fp8 experts equal to the same matmul on the
dequantized weights (every implementation), a whole fp8 model's forward equal to the forward on HF-style
dequantized bf16 weights, ~1 byte per quantized weight (the 671B model's abstract params), and train.py's
refusal."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import model_state
from MaxText.config.types import ConfigError
from MaxText.kernels import backend, moe_experts
from MaxText.kernels.fp8_blocks import FP8, BlockFP8, block_of, dequantize, quantize, scale_shape
from MaxText.layers.linears import SCALE_SUFFIX, kernel_block, requantized
from MaxText.runtime import sharding
from tests.conftest import make_config


def _reference_quantize(w: np.ndarray, block, scales=None):
  """DeepSeek's recipe one block at a time: scale = max|w| / 448 (1 for a zero block), values = w / scale;
  given `scales`, the values of w under those."""
  k, n = w.shape
  bk, bn = block
  scale = np.ones((-(-k // bk), -(-n // bn)), np.float32)
  values = np.zeros_like(w)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      blk = w[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn]
      amax = np.abs(blk).max()
      scale[i, j] = amax / np.float32(448.0) if amax > 0 else 1.0
      scale[i, j] = scale[i, j] if scales is None else scales[i, j]
      values[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn] = blk / scale[i, j]
  return values.astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("shape,block", [((200, 70), (128, 64)), ((48, 40), (16, 32)), ((64, 64), (32, 64))])
def test_quantize_matches_the_per_block_recipe_and_dequantize_is_values_times_block_scale(shape, block):
  w = np.array(jax.random.normal(jax.random.key(1), shape), np.float32)
  w[:block[0], :block[1]] = 0.0  # an all-zero block: scale 1, values 0 (no 0/0)
  q = quantize(jnp.asarray(w), block)
  assert q.values.dtype == FP8 and q.scale.dtype == jnp.float32
  assert q.scale.shape == scale_shape(shape, block) == _reference_quantize(w, block)[1].shape  # ceil: edge blocks
  assert block_of(q.values.shape, q.scale.shape) == block
  np.testing.assert_allclose(np.asarray(q.scale), _reference_quantize(w, block)[1], rtol=3e-7)  # XLA: x * (1/448)
  values, scale = _reference_quantize(w, block, np.asarray(q.scale))
  np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), values.view(np.uint8))
  expanded = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:shape[0], :shape[1]]
  deq = np.asarray(dequantize(q))
  np.testing.assert_array_equal(deq, values.astype(np.float32) * expanded)
  assert np.all(np.abs(deq - w) <= expanded * 448 / 16)  # e4m3: 3 mantissa bits, half an ulp of the block max
  assert np.asarray(dequantize(q, jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("impl,limit", [("blocked", None), ("blocked", 1), ("ragged_dot", None), ("ragged_dot", 2000)])
def test_grouped_matmul_on_fp8_experts_equals_it_on_the_dequantized_weights(impl, limit, monkeypatch):
  # limit: BLOCK_WEIGHT_COPY_LIMIT small enough for the blocked path's per-block loop, or for ragged_dot to
  # dequantize 2 of the 8 experts at a time (the rows of each chunk rolled to the front and back).
  if limit is not None:
    monkeypatch.setattr(moe_experts, "BLOCK_WEIGHT_COPY_LIMIT", limit)
  e, d, i, t, k = 8, 32, 24, 12, 3
  keys = jax.random.split(jax.random.key(0), 6)
  w = [quantize(jax.random.normal(kk, s) * 0.3, (16, 8)) for kk, s in zip(keys[:3], [(e, d, i), (e, d, i), (e, i, d)])]
  x = jax.random.normal(keys[3], (t, d))
  ids = jax.random.randint(keys[4], (t, k), 0, e)
  valid = jax.random.uniform(keys[5], (t, k)) > 0.2  # invalid assignments: the null group
  fp8 = moe_experts.ExpertWeights(*w)
  deq = moe_experts.ExpertWeights(*(dequantize(a) for a in w))
  run = jax.jit(lambda ws: moe_experts.expert_outputs(x, ids, ws, impl=impl, valid=valid, block_rows=4))
  got, want = run(fp8), run(deq)
  assert float(jnp.max(jnp.abs(want))) > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_no_float_copy_of_all_experts_in_the_compiled_expert_kernel(impl, monkeypatch):
  # ragged_dot dequantizes 4 experts at a time; the blocked path (above the copy limit) one expert per block.
  e, d, i, t, k = 16, 64, 32, 8, 2
  monkeypatch.setattr(moe_experts, "BLOCK_WEIGHT_COPY_LIMIT", 4 * d * i)
  keys = jax.random.split(jax.random.key(0), 5)
  w = [quantize(jax.random.normal(kk, s), (16, 16)) for kk, s in zip(keys[:3], [(e, d, i), (e, d, i), (e, i, d)])]
  x = jax.random.normal(keys[3], (t, d)).astype(jnp.bfloat16)
  ids = jax.random.randint(keys[4], (t, k), 0, e)
  f = jax.jit(lambda ws: moe_experts.expert_outputs(x, ids, ws, impl=impl, block_rows=4))
  hlo = f.lower(moe_experts.ExpertWeights(*w)).compile().as_text()
  for dtype in ("f32", "bf16"):
    for shape in (f"[{e},{d},{i}]", f"[{e},{i},{d}]"):
      assert dtype + shape not in hlo, f"a {dtype}{shape} copy of every expert"
  assert f"f8e4m3fn[{e},{d},{i}]" in hlo  # the weights enter as fp8


def _forward(cfg, params, buffers, tokens):
  graphdef = model_state.abstract_model(cfg)[0]
  return nnx.jit(lambda m, t: m(t)[0])(model_state.merge(graphdef, params, buffers), tokens)


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_fp8_model_forward_equals_the_forward_on_hf_style_dequantized_bf16_weights():
  # HF / DeepSeek's weight_dequant: fp8 * scale in fp32, stored bf16; the float model runs on those.
  # The rest of the weights (embeddings, norms, router, head) bf16 in both, as in DeepSeek's checkpoints.
  over = dict(dtype="bfloat16", weight_dtype="bfloat16", weight_block_size=(16, 32), mtp_num_layers=0,
              param_init_std=0.2)
  cfg8 = make_config(weight_quantization="fp8_block", **over)
  cfg = make_config(**over)
  _, params8, buffers, _ = model_state.create(cfg8, sharding.create_mesh(cfg8))
  abstract = model_state.abstract_model(cfg)[1].to_pure_dict()
  params = requantized(params8, abstract, kernel_block(cfg8))
  params = jax.tree.map(lambda a, s: jnp.asarray(a).astype(s.dtype), params, abstract)  # fp32 -> bf16
  assert sum(a.dtype == FP8 for a in jax.tree.leaves(params8)) >= 10  # attention, indexer, MLP, experts
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)
  got = np.asarray(_forward(cfg8, params8, buffers, tokens), np.float32)
  want = np.asarray(_forward(cfg, params, buffers, tokens), np.float32)
  assert np.abs(want).max() > 0.1
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())  # bf16 tolerance


def _quantized_and_scales(params) -> tuple[int, int]:
  """(elements of fp8 weights, elements of their scales) of a params tree."""
  n = s = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = str(getattr(path[-1], "key", path[-1]))
    if leaf.dtype == FP8:
      n += leaf.size
    elif name.endswith(SCALE_SUFFIX):
      s += leaf.size
  return n, s


def test_fp8_params_take_one_byte_per_quantized_weight_plus_scales_671b():
  """The abstract params of the 671B config (what a serving fit report builds): every block-quantized
  weight 1 byte, one fp32 scale per 128 x 128 block, the rest (embeddings, head, norms, router) bf16."""
  cfg8 = make_config(model_name="deepseek3.2-671b", weight_quantization="fp8_block")
  cfg = make_config(model_name="deepseek3.2-671b")  # weight_dtype bfloat16
  p8, p = model_state.abstract_model(cfg8)[1], model_state.abstract_model(cfg)[1]
  n, s = _quantized_and_scales(p8.to_pure_dict())
  assert s * 128 * 128 >= n > 0.95 * s * 128 * 128  # one scale per block; few partial blocks
  assert model_state.param_bytes(p8) == model_state.param_bytes(p) - n * (2 - 1) + 4 * s
  assert n / model_state.count_params(p) > 0.98  # nearly every weight of the 671B model is quantized
  gib = model_state.param_bytes(p8) / 2**30
  assert 620 < gib < 660, gib  # ~ DeepSeek's 689 GB fp8 checkpoint (which has no MTP embedding copies)


def test_train_refuses_fp8_weights():
  from MaxText import train
  cfg = make_config(weight_quantization="fp8_block")
  with pytest.raises(ConfigError, match="weight_quantization=fp8_block"):
    train.make_optimizer(cfg, model_state.abstract_model(cfg)[1])


def test_block_sizes_must_be_powers_of_2():
  with pytest.raises(Exception, match="weight_block_size"):
    make_config(weight_block_size=(96, 128))


def test_requantized_keeps_fp8_quantizes_float_and_dequantizes_where_the_model_is_float():
  w = jax.random.normal(jax.random.key(0), (40, 24))
  q = quantize(w, (16, 8))
  like_fp8 = {"a": {"kernel": q.values, "kernel_scale": q.scale}, "b": {"kernel": q.values, "kernel_scale": q.scale}}
  out = requantized({"a": {"kernel": q.values, "kernel_scale": q.scale}, "b": {"kernel": w}}, like_fp8, (16, 8))
  assert out["a"]["kernel"] is q.values and out["a"]["kernel_scale"] is q.scale  # kept: no dequantize
  np.testing.assert_array_equal(np.asarray(out["b"]["kernel"]).view(np.uint8), np.asarray(q.values).view(np.uint8))
  back = requantized({"k": {"kernel": q.values, "kernel_scale": q.scale}}, {"k": {"kernel": w}}, (16, 8))
  np.testing.assert_array_equal(np.asarray(back["k"]["kernel"]), np.asarray(dequantize(BlockFP8(*q))))
  assert set(back["k"]) == {"kernel"}


@pytest.mark.parametrize("per_row,dtype", [(1, "int32"), (2, "int32"), (4, "int32"), (8, "int32"), (16, "uint32"),
                                           (8, "float32"), (16, "float32")])
def test_take_slots_picks_each_slot_from_its_row_with_one_gather(per_row, dtype):
  """take_slots over a pool of per_row slots a row equals a plain row gather over the same slots one a row, for
  every slot place (first, last, the clipped ids past either end), and its compiled program gathers once: the
  slot is picked from its gathered row by selects (up to PICK_SELECTS slots a row) or a masked sum (more: the
  latent's f32 scales, 32 a row), not by a second (take_along_axis) gather; f32 values come back bit for bit."""
  from MaxText.kernels.fp8_blocks import take_slots
  n, w = 64, 4  # 64 slots of 4 words (4 rows at 16 a row: a 1-row pool compiles to no gather)
  flat = (jnp.arange(n * w, dtype=jnp.int32).reshape(n, w) * 7 + 3).astype(dtype)  # [N, w] slot s holds its own words
  if dtype == "float32":
    flat = flat * -1.37e-3 + 2.5e30  # neither small integers nor exact sums of them
  pool = flat.reshape(n // per_row, per_row * w)  # [N/per_row, per_row*w]: slot s in row s // per_row
  ids = jnp.asarray([[0, 1, 2, 3, 5], [n - 1, n - 2, 8, -4, n + 9]], jnp.int32)
  got = take_slots(pool, ids, per_row)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(flat)[np.clip(np.asarray(ids), 0, n - 1)])
  hlo = jax.jit(lambda p, i: take_slots(p, i, per_row)).lower(pool, ids).compile().as_text()
  assert sum(" gather(" in line for line in hlo.split("\n")) == 1, [l for l in hlo.split("\n") if " gather(" in l]


@pytest.mark.parametrize("quantized", [False, True])
def test_a_matmul_pins_its_output_row_major_exactly_when_it_has_fewer_rows_than_the_weight(quantized):
  # fp8_blocks.matmul's output [..., N] of a weight [K, N] is pinned row-major below K rows (a decode step's: XLA's
  # TPU layout assignment otherwise relaid out the weight every step), left free from K rows on (training's) and on
  # the CPU's row; the values are the plain matmul's either way (the pin is a layout, not arithmetic).
  from MaxText.kernels.fp8_blocks import matmul
  k, n = 256, 128
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  w = quantize(w, (128, 128)) if quantized else w
  dense = dequantize(w, jnp.float32) if quantized else w
  for way, rows, pinned in (("few_rows_pinned", k - 1, True), ("few_rows_pinned", k, False),
                            ("few_rows_pinned", 2, True), ("free", 2, False)):
    x = jnp.asarray(rng.standard_normal((1, rows, k)), jnp.float32)  # [b, t, K]: rows = b * t
    with backend.forced(matmul_layout=way):  # the tpu row's way, and the cpu's (traced inside the block)
      f = jax.jit(lambda x, w: matmul(x, w, jnp.float32))
      assert ("LayoutConstraint" in f.lower(x, w).as_text()) == pinned, (way, rows, pinned)
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x) @ np.asarray(dense), rtol=1e-4, atol=1e-4)
