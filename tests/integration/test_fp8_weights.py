"""Serving on fp8 block-quantized weights (weight_quantization=fp8_block): the continuous-batching engine's
greedy tokens on the fp8 weights equal its tokens on the same weights dequantized (the float model); the
weights stay fp8 in the engine's params; fp8 experts under expert and tensor parallelism, and the whole fp8
model on a tensor x expert mesh, equal one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.checkpoint import model_state
from MaxText.config.types import ConfigError
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.kernels.fp8_blocks import FP8, dequantize, quantize
from MaxText.layers.linears import kernel_block, requantized
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.decode_cli import decode_cli
from tests.support.sharded import layer_inputs, moe_on_mesh_of, moe_single_device

BASE = dict(max_target_length=32, max_prefill_length=16, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=2, serve_max_num_tokens=16, prefill_chunk_size=8,
            weight_block_size=(16, 32),
            serve_width_buckets=1, serve_context_buckets=1)  # few step shapes: few compiles (the server tests run the defaults)
PROMPTS = [[1, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 99, 7]]
NEW = 6


def test_serving_on_fp8_weights_equals_serving_on_the_dequantized_weights():
  cfg8, cfg = make_config(weight_quantization="fp8_block", **BASE), make_config(**BASE)
  _, params8, buffers, _ = model_state.create(cfg8, sharding.create_mesh(cfg8))
  graphdef8 = model_state.abstract_model(cfg8)[0]
  graphdef, abstract, _ = model_state.abstract_model(cfg)
  abstract = abstract.to_pure_dict()
  params = jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype), requantized(params8, abstract, kernel_block(cfg8)),
                        abstract)
  greedy = SamplingParams(max_tokens=NEW)

  eng8 = ServingEngine(cfg8, graphdef8, params8, buffers, eos_id=-1)
  got = [r.output for r in eng8.generate(PROMPTS, greedy)]
  want = [r.output for r in ServingEngine(cfg, graphdef, params, buffers, eos_id=-1).generate(PROMPTS, greedy)]
  assert got == want and all(len(o) == NEW for o in got)
  assert len({tuple(o) for o in got}) > 1  # not one token sequence for every prompt
  assert sum(a.dtype == FP8 for a in jax.tree.leaves(eng8.params)) >= 10  # still fp8 in the engine
  assert all(a is None for a in eng8.absorbed.values())  # no float copy of wkv_b: dequantized in the step


@pytest.mark.parametrize("mesh", [dict(ici_tensor_parallelism=2, ici_expert_parallelism=4),
                                  dict(ici_expert_parallelism=8)], ids=["tensor2xexpert4", "expert8"])
def test_fp8_experts_on_a_mesh_equal_one_device_on_the_dequantized_weights(mesh):
  # Each device dequantizes its own experts' (and hidden shard's) blocks inside the shard_map.
  b, t, d, e, k, i = 4, 8, 32, 8, 2, 32
  cfg = make_config(num_devices=8, num_experts=e, **mesh)
  x, gate, bias, *weights = layer_inputs(b, t, d, e, i, skew=0.0)
  fp8 = [quantize(w, (16, 16)) for w in weights]  # a tensor shard of I = 32 / 2 holds one whole block
  y, counts, _ = moe_on_mesh_of(cfg, (x, gate, bias, *fp8), jnp.ones((b, t), bool), k, capacity_factor=-1.0,
                          exchange="all_to_all")
  want, ids = moe_single_device((x, gate, bias, *(dequantize(w) for w in fp8)), k)
  np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(counts, np.bincount(np.asarray(ids).reshape(-1), minlength=e))
  bad = [quantize(w, (32, 32)) for w in weights]  # 32 / 2 = 16 rows of a 32-row block per shard
  with pytest.raises(ValueError, match="weight_block_size"):
    moe_on_mesh_of(make_config(num_devices=8, num_experts=e, ici_tensor_parallelism=2, ici_expert_parallelism=4),
             (x, gate, bias, *bad), jnp.ones((b, t), bool), k, capacity_factor=-1.0, exchange="all_to_all")


def test_fp8_model_on_a_tensor_x_expert_mesh_equals_one_device():
  # GSPMD shards every fp8 kernel and its scales alike (sharding.py's rules on the same logical axes);
  # each dequantizes where it lies.
  over = dict(weight_quantization="fp8_block", weight_block_size=(16, 16), mtp_num_layers=0, param_init_std=0.2,
              global_batch_size=8)
  cfg1 = make_config(**over)
  _, params, buffers, _ = model_state.create(cfg1, sharding.create_mesh(cfg1))
  tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, cfg1.vocab_size)

  def forward(cfg):
    mesh = sharding.create_mesh(cfg)
    graphdef, abs_p, abs_b = model_state.abstract_model(cfg)
    p_shard, b_shard = model_state.shardings_of(cfg, mesh, abs_p, abs_b)
    p, b = jax.device_put(params, p_shard), jax.device_put(buffers, b_shard)
    with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
      return np.asarray(jax.jit(lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0])(p, b, tokens))

  want = forward(cfg1)
  got = forward(make_config(num_devices=8, ici_tensor_parallelism=2, ici_expert_parallelism=4, **over))
  assert np.abs(want).max() > 1
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_checkpoint_of_the_other_weight_quantization_is_one_config_error_naming_both(tmp_path):
  # Read from the stored tree's metadata (kernel_scale leaves or none) before any array: no orbax traceback.
  def zeros_checkpoint(path, cfg):  # only the tree is read here
    _, p, b = model_state.abstract_model(cfg)
    zeros = lambda tree: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree.to_pure_dict())  # noqa: E731
    model_state.save_parameters(path, zeros(p), zeros(b))

  fp8, plain = make_config(weight_quantization="fp8_block", **BASE), make_config(**BASE)
  for saved, loaded, have, want in ((fp8, plain, "fp8_block", "none"), (plain, fp8, "none", "fp8_block")):
    path = str(tmp_path / have)
    zeros_checkpoint(path, saved)
    with pytest.raises(ConfigError, match=f"weight_quantization={want} does not fit load_parameters_path=.*converted "
                                          f"with weight_quantization={have}; set weight_quantization={have}"):
      model_state.load_parameters(path, loaded, sharding.create_mesh(loaded))
  r = decode_cli(f"load_parameters_path={tmp_path / 'fp8_block'}", "prompt=1,2", "weight_block_size=[16,32]",
           "mtp_num_layers=0", timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "weight_quantization=none does not fit" in r.stderr and "with weight_quantization=fp8_block" in r.stderr
