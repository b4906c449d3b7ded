"""LoRA (layers/lora.py, Linear's adapter, train.py's adapter-only state): which linears the default regex
adapts, each bad key one line, the output at step 0 equal to the base's (float and fp8 base), the fp8 base's
chunked matmul equal to the dense one on its dequantized weight, the merged kernel equal to the unmerged
linear, and training that moves the adapters only: no gradient or optimizer state for the base, whose bits
stay as they were."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import orbax_state
from MaxText.config.types import ConfigError
from MaxText.kernels import fp8_blocks
from MaxText.kernels.fp8_blocks import dequantize, quantize
from MaxText.layers import lora
from MaxText.layers.models import Transformer
from tests.conftest import make_config
from tests.support.lora import small_lora_config, train_steps

TOKENS = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 37) % 500


def _adapted(model) -> list[str]:
  return [re_path for re_path, m in lora.linears(model) if m.lora_a is not None]


def test_default_regex_adapts_mla_q_kv_o_the_dense_and_shared_mlps_and_the_indexers_q_k_and_head_weights_only():
  cfg = make_config(lora_rank=4)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  got = set(_adapted(model))
  for stack in ("dense_layers/layers", "moe_layers/layers", "mtp/0/layer"):
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
      assert f"{stack}/attention/{name}" in got
  for name in ("gate", "up", "down"):
    assert f"dense_layers/layers/mlp/{name}" in got and f"moe_layers/layers/mlp/shared_experts/{name}" in got
  for stack in ("dense_layers/layers", "moe_layers/layers", "mtp/0/layer"):  # the indexer follows the adapted attention
    assert {f"{stack}/attention/indexer/{name}" for name in ("wq_b", "wk", "weights_proj")} <= got  # [64, 4]: rank 4 fits
  assert not any(p in ("output_head", "mtp/0/projection") for p in got)
  assert lora.skipped(model, cfg) == []
  a = model.moe_layers.layers.attention.wq_b
  assert a.lora_a.shape == (3, 32, 4) and a.lora_b.shape == (3, 4, 96)  # stacked [L, in, r], [L, r, out]
  assert a.lora_a.get_metadata()["logical_axes"] == ("q_lora", "lora_rank")
  assert a.lora_b.get_metadata()["logical_axes"] == ("lora_rank", "q_heads")
  assert a.lora_scale == 16.0 / 4


def test_the_default_regex_leaves_out_a_kernel_narrower_than_lora_rank_and_names_it():
  """At lora_rank 8 the indexer's weights_proj [64, 4] (indexer_n_heads 4) keeps no adapter under the default
  lora_module_path (a rank-8 update of it would be full rank; never a silently smaller rank): `skipped` names it
  for train.py's line, every other default linear is adapted at rank 8."""
  cfg = make_config(lora_rank=8)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  got = set(_adapted(model))
  assert not any(p.endswith("weights_proj") for p in got)
  assert {"moe_layers/layers/attention/indexer/wk", "mtp/0/layer/attention/wkv_b"} <= got
  assert lora.skipped(model, cfg) == [f"{stack}/attention/indexer/weights_proj [64, 4]"
                                      for stack in ("dense_layers/layers", "moe_layers/layers", "mtp/<i>/layer")]
  assert all(m.lora_a.shape[-1] == 8 for _, m in lora.linears(model) if m.lora_a is not None)
  named = make_config(lora_rank=8, lora_module_path=cfg.lora_module_path.replace("weights_proj", "weights_proj|wq_a"))
  assert lora.skipped(model, named) == []  # not the default: refused instead (below)


def test_indexer_is_selectable():
  cfg = make_config(lora_rank=4, lora_module_path=".*/indexer/(wq_b|wk)")
  got = _adapted(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  assert got and all(p.endswith(("indexer/wq_b", "indexer/wk")) for p in got)


@pytest.mark.parametrize("keys,said", [
    (dict(lora_rank=4, lora_module_path=".*/attention/nope"),
     "lora_module_path='.*/attention/nope' matches no linear of this model; its linears are: dense_layers"),
    (dict(lora_rank=40, lora_module_path=".*/attention/wkv_b"),
     r"lora_rank=40 exceeds the smaller side of dense_layers/layers/attention/wkv_b's kernel \[32, 128\] \(matched by "
     r"lora_module_path='.\*/attention/wkv_b'\): use lora_rank <= 32"),
    (dict(lora_rank=8, lora_module_path=".*/indexer/(wk|weights_proj)"),
     r"lora_rank=8 exceeds the smaller side of dense_layers/layers/attention/indexer/weights_proj's kernel \[64, 4\] "
     r"\(matched by lora_module_path='.\*/indexer/\(wk\|weights_proj\)'\): use lora_rank <= 4 or a lora_module_path "
     r"without it"),
    (dict(lora_rank=40, lora_module_path=".*/mlp/wo"),
     r"lora_rank=40 exceeds the smaller side of moe_layers/layers/mlp/wo's kernel \[32, 64\]"),
    (dict(lora_rank=4, lora_module_path=".*/mlp/(wi_0|wi_1|wo)", serve_lora_adapters=("a=/tmp/a",)),
     r"serve_lora_adapters: lora_module_path='.\*/mlp/\(wi_0\|wi_1\|wo\)' adapts the routed experts \(moe_layers"),
])
def test_a_bad_lora_key_is_one_line_naming_the_key_and_what_it_matched(keys, said):
  cfg = make_config(**keys)
  with pytest.raises(ConfigError, match=said) as e:
    nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  assert "\n" not in str(e.value)


EXPERTS = ".*/mlp/(wi_0|wi_1|wo)"


def test_routed_experts_are_selectable_as_per_expert_adapters_sharded_as_the_experts():
  cfg = make_config(lora_rank=4, lora_module_path=EXPERTS)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  assert not _adapted(model)  # no linear
  mlp = model.moe_layers.layers.mlp
  assert mlp.wi_0_lora.lora_a.shape == (3, 8, 64, 4) and mlp.wi_0_lora.lora_b.shape == (3, 8, 4, 32)  # [L,E,D,r] [L,E,r,I]
  assert mlp.wo_lora.lora_a.shape == (3, 8, 32, 4) and mlp.wo_lora.lora_b.shape == (3, 8, 4, 64)  # [L,E,I,r] [L,E,r,D]
  assert mlp.wi_1_lora.lora_a.get_metadata()["logical_axes"] == ("exp", "embed", "lora_rank")
  assert mlp.wo_lora.lora_b.get_metadata()["logical_axes"] == ("exp", "lora_rank", "embed")
  assert mlp.wo_lora.lora_scale == 16.0 / 4 and model.mtp[0].layer.mlp.wi_0_lora is not None


def _moe_pair(impl, **kw):
  """(a DeepSeekMoE with per-expert adapters on wi_0, wi_1, wo, the same layer without them), one input x."""
  from MaxText.layers.moe import DeepSeekMoE
  cfg = make_config(lora_rank=4, lora_module_path="(wi_0|wi_1|wo)", matmul_precision="highest",
                    weight_block_size=(16, 16), **kw)
  adapted, plain = DeepSeekMoE(cfg, rngs=nnx.Rngs(0)), DeepSeekMoE(cfg, rngs=nnx.Rngs(0))
  lora.add_adapters(adapted, cfg, nnx.Rngs(1))
  adapted.dispatch = plain.dispatch = impl
  return cfg, adapted, plain, jax.random.normal(jax.random.key(2), (2, 8, cfg.emb_dim))  # x [b,t,D]


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_routed_expert_adapters_leave_the_output_at_step_0_and_then_change_it(impl, quant):
  _, adapted, plain, x = _moe_pair(impl, weight_quantization=quant)
  np.testing.assert_array_equal(np.asarray(adapted(x)[0]), np.asarray(plain(x)[0]))
  b = adapted.wo_lora.lora_b
  b[...] = jnp.full(b.shape, 0.05, b.dtype)
  assert not np.allclose(np.asarray(adapted(x)[0]), np.asarray(plain(x)[0]), atol=1e-3)


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
def test_routed_expert_adapters_equal_their_merged_weights_expert_by_expert(impl):
  cfg, adapted, plain, x = _moe_pair(impl)
  for name in ("wi_0", "wi_1", "wo"):
    b = getattr(adapted, name + "_lora").lora_b
    b[...] = 0.1 * jax.random.normal(jax.random.key(len(name)), b.shape)
  _, params, _ = nnx.split(adapted, nnx.Param, ...)
  adapters, base = lora.split(jax.tree.map(np.asarray, params.to_pure_dict()))
  assert set(adapters) == {"wi_0_lora", "wi_1_lora", "wo_lora"}
  g, _, rest = nnx.split(plain, nnx.Param, ...)
  merged = nnx.merge(g, lora.merged(base, adapters, cfg.lora_alpha / cfg.lora_rank, (16, 16)), rest.to_pure_dict())
  np.testing.assert_allclose(np.asarray(adapted(x)[0]), np.asarray(merged(x)[0]), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(adapted(x)[0]), np.asarray(plain(x)[0]), atol=1e-3)


def test_a_regex_that_does_not_compile_is_a_config_error():
  with pytest.raises(ConfigError, match="lora_module_path.*not a regular expression"):
    make_config(lora_rank=4, lora_module_path="(wq_a")


def test_lora_restore_path_without_lora_rank_is_a_config_error():
  with pytest.raises(ConfigError, match="lora_restore_path=/runs/sft needs lora_rank > 0"):
    make_config(lora_restore_path="/runs/sft")


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_output_at_step_0_equals_the_base_exactly(quant):
  kw = dict(weight_quantization=quant, weight_block_size=(16, 16))
  base = Transformer(make_config(**kw), rngs=nnx.Rngs(0))
  adapted = Transformer(make_config(lora_rank=4, **kw), rngs=nnx.Rngs(0))
  assert _adapted(adapted) and not _adapted(base)
  np.testing.assert_array_equal(np.asarray(adapted(TOKENS)[0]), np.asarray(base(TOKENS)[0]))
  # and the adapter is live: a nonzero B changes the output
  b = adapted.moe_layers.layers.attention.wo.lora_b
  b[...] = jnp.full(b.shape, 0.05, b.dtype)
  assert not np.allclose(np.asarray(adapted(TOKENS)[0]), np.asarray(base(TOKENS)[0]), atol=1e-3)


@pytest.mark.parametrize("k,n,block", [
    (512, 48, (32, 16)),  # 16 K-blocks: 8 chunks of 2
    (250, 70, (16, 32)),  # 16 K-blocks, the last partial (10 rows), partial N-blocks too
    (208, 40, (16, 8)),  # 13 K-blocks: 7 chunks of 2, the last of 1
    (64, 40, (64, 8)),  # one K-block: one chunk
])
def test_fp8_matmul_by_chunks_of_blocks_equals_the_dense_matmul_on_the_dequantized_weight(k, n, block):
  w = quantize(jax.random.normal(jax.random.key(0), (k, n)), block)
  x = jax.random.normal(jax.random.key(1), (3, 5, k))
  hi = jax.lax.Precision.HIGHEST
  got = fp8_blocks.matmul(x, w, jnp.float32, hi)
  want = np.einsum("btk,kn->btn", np.asarray(x, np.float64), np.asarray(dequantize(w), np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert got.shape == (3, 5, n) and got.dtype == jnp.float32


def test_fp8_matmul_never_dequantizes_the_whole_weight():
  w = quantize(jax.random.normal(jax.random.key(0), (1024, 256)), (128, 128))  # 8 K-blocks: 8 chunks of 1
  hlo = jax.jit(lambda x, v, s: fp8_blocks.matmul(x, fp8_blocks.BlockFP8(v, s), jnp.float32)).lower(
      jnp.ones((4, 1024)), w.values, w.scale).as_text()
  assert "1024x256xf32" not in hlo and "128x256xf32" in hlo


def test_merged_kernel_equals_the_unmerged_linear_and_kernel_value_is_the_base_alone():
  cfg = make_config(lora_rank=4, matmul_precision="highest")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  lin = model.mtp[0].layer.attention.wkv_b
  lin.lora_b[...] = jax.random.normal(jax.random.key(2), lin.lora_b.shape) * 0.1
  x = jax.random.normal(jax.random.key(3), (2, 7, 32))
  merged = lin.kernel[...] + lin.lora_scale * lin.lora_a[...] @ lin.lora_b[...]  # [in, out]
  want = jnp.einsum("bti,io->bto", x, merged, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(lin(x)), np.asarray(x @ lin.kernel[...]), atol=1e-3)
  # the adapter is never added into the kernel (kernels/low_rank.py): absorbed MLA adds it apart
  np.testing.assert_array_equal(np.asarray(lin.kernel_value()), np.asarray(lin.kernel[...]))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("quant", ["fp8_block"])  # the QLoRA base; its norms, router and head are float leaves
def test_training_moves_only_the_adapters_and_leaves_the_base_bits(quant):
  cfg = small_lora_config(weight_quantization=quant)
  cfg = small_lora_config(weight_quantization=quant, lora_module_path=f"{cfg.lora_module_path}|{EXPERTS}")
  first, last, metrics = train_steps(cfg, 2)
  adapters = jax.tree_util.tree_leaves_with_path(last["params"])
  assert adapters and all(lora.is_adapter(p) for p, _ in adapters)
  assert last["buffers"] == {}
  # AdamW's two moments per adapter (+ counts): nothing for the base
  moments = [x for x in jax.tree.leaves(last["opt_state"]) if x.ndim]
  assert len(moments) == 2 * len(adapters)
  base = jax.tree_util.tree_leaves_with_path(last[orbax_state.FROZEN])
  assert not any(lora.is_adapter(p) for p, _ in base)
  assert any(x.dtype == fp8_blocks.FP8 for _, x in base) == (quant == "fp8_block")
  for (path, x), y in zip(base, jax.tree.leaves(first[orbax_state.FROZEN])):
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)
  for layer in ("attention", "wo"), ("mlp", "wi_1_lora"):  # a linear's adapter, an expert weight's
    b = last["params"]["moe_layers"]["layers"][layer[0]][layer[1]]["lora_b"]
    assert np.abs(first["params"]["moe_layers"]["layers"][layer[0]][layer[1]]["lora_b"]).max() == 0 < np.abs(b).max()
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_adapters_merged_into_the_base_give_the_adapted_models_logits():
  cfg = make_config(lora_rank=4, matmul_precision="highest", mtp_num_layers=0)
  adapted = Transformer(cfg, rngs=nnx.Rngs(0))
  for _, m in lora.linears(adapted):
    if m.lora_b is not None:
      m.lora_b[...] = jax.random.normal(jax.random.key(5), m.lora_b.shape) * 0.05
  graphdef, params, buffers = nnx.split(adapted, nnx.Param, ...)
  adapters, base = lora.split(jax.tree.map(np.asarray, params.to_pure_dict()))
  merged = lora.merged(base, adapters, cfg.lora_alpha / cfg.lora_rank, (16, 16))
  plain_cfg = make_config(matmul_precision="highest", mtp_num_layers=0)
  plain = Transformer(plain_cfg, rngs=nnx.Rngs(0))
  g, p, b = nnx.split(plain, nnx.Param, ...)
  plain = nnx.merge(g, merged, b.to_pure_dict())
  want, got = np.asarray(adapted(TOKENS)[0]), np.asarray(plain(TOKENS)[0])
  assert not np.allclose(want, np.asarray(Transformer(plain_cfg, rngs=nnx.Rngs(0))(TOKENS)[0]), atol=1e-3)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
