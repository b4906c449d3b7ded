"""GRPO's reference policy (post_train/reference.py) under LoRA: the base with the adapters off, reading the
train state's own frozen arrays (no copy), bit for bit the base model's logprobs, the policy's exactly while
B = 0 (KL 0); and the engine serving the policy's adapters swapped in without recompiling (MaxText/rl.py's
policy_weights into ServingEngine.load_weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import rl, train
from MaxText.checkpoint import model_state, orbax_state
from MaxText.inference.scheduler import SamplingParams
from MaxText.layers import lora
from MaxText.post_train import grpo
from MaxText.post_train.reference import Reference
from MaxText.post_train.rollout_batch import scored_logprobs
from MaxText.runtime import sharding
from tests.support.lora import small_lora_config

ARRAYS = {"tokens": (np.arange(32, dtype=np.int32).reshape(2, 16) * 37) % 500,
          "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)), "segment_ids": np.ones((2, 16), np.int32)}


def _state(cfg):
  """(graphdef, the train state init_state gives, its mesh) for cfg: under LoRA {adapters, frozen base}."""
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, _, _ = train.init_state(cfg, mesh)
  return graphdef, state, mesh


def _logprobs(cfg, graphdef, params, buffers, mesh):
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    return np.asarray(jax.jit(lambda p, b: scored_logprobs(cfg, model_state.merge(graphdef, p, b), ARRAYS, None))(
        params, buffers))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_the_lora_reference_is_the_base_model_bit_for_bit_and_the_policy_exactly_while_b_is_zero(quant):
  cfg = small_lora_config(weight_quantization=quant)
  graphdef, state, mesh = _state(cfg)
  base_cfg = small_lora_config(weight_quantization=quant, lora_rank=0)
  with jax.set_mesh(mesh), sharding.logical_rules(base_cfg, mesh):
    base_graphdef, params, buffers, _ = model_state.create(base_cfg, mesh)  # the base's draws precede the adapters'
  frozen = state[orbax_state.FROZEN]
  jax.tree.map(np.testing.assert_array_equal, frozen, lora.join(params, buffers))
  base = _logprobs(base_cfg, base_graphdef, params, buffers, mesh)
  reference = Reference(cfg, graphdef, state, None)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    ref = np.asarray(reference(state, ARRAYS))
  np.testing.assert_array_equal(ref, base)  # adapters off: the base model's forward
  policy = _logprobs(cfg, graphdef, state["params"], frozen, mesh)
  np.testing.assert_array_equal(policy, ref)  # B = 0: the policy is the reference
  assert float(grpo.kl_estimate(jnp.asarray(policy), jnp.asarray(policy), jnp.asarray(ref)).max()) == 0.0
  moved = dict(state, params=jax.tree.map(lambda x: x + 0.05, state["params"]))  # an update moved A and B
  assert np.abs(_logprobs(cfg, graphdef, moved["params"], frozen, mesh) - ref)[:, 1:].min() > 0
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    np.testing.assert_array_equal(np.asarray(reference(moved, ARRAYS)), ref)  # the adapters never reach it


def _model_state(cfg):
  """(graphdef, the train state's model entries as train.model_parts lays them out), zeros: nothing compiled."""
  graphdef, params, buffers = model_state.abstract_model(cfg)
  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree.to_pure_dict())  # noqa: E731
  return graphdef, train.model_parts(cfg, zeros(params), zeros(buffers))


def test_the_lora_reference_holds_no_weights_while_the_full_fine_tunes_holds_a_copy():
  """rl_beta > 0 under LoRA costs no memory: the reference reads the state's frozen arrays themselves."""
  cfg = small_lora_config()
  graphdef, state = _model_state(cfg)
  reference = Reference(cfg, graphdef, state, None)
  params, buffers = reference.weights(state)
  assert reference.held_bytes() == 0 and params == {}
  assert buffers is state[orbax_state.FROZEN]
  assert "no copy of the weights" in reference.describe()
  full_cfg = small_lora_config(lora_rank=0)
  graphdef, state = _model_state(full_cfg)
  full = Reference(full_cfg, graphdef, state, None)
  assert full.held_bytes() == model_state.param_bytes(state["params"]) > 0
  assert not any(a is b for a, b in zip(jax.tree.leaves(full.weights(state)[0]), jax.tree.leaves(state["params"])))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_adapters_swapped_into_the_engine_serve_as_an_engine_built_with_them_and_compile_nothing():
  cfg = small_lora_config(serve_max_num_seqs=2, serve_width_buckets=1, serve_context_buckets=1, use_indexer=False)
  graphdef, state, mesh = _state(cfg)
  prompts = [[5, 9, 13, 2], [7, 3, 11]]
  greedy = SamplingParams(max_tokens=6, ignore_eos=True)
  moved = dict(state, params=jax.tree.map(lambda x: x + 0.05, state["params"]))
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    engine = rl.ServingEngine(cfg, graphdef, *rl.policy_weights(state))
    before = [r.output for r in engine.generate(prompts, greedy)]
    programs = engine.step_programs()
    engine.load_weights(*rl.policy_weights(moved))
    swapped = [r.output for r in engine.generate(prompts, greedy)]
    assert engine.step_programs() == programs  # the swap compiled nothing
    fresh = [r.output for r in rl.ServingEngine(cfg, graphdef, *rl.policy_weights(moved)).generate(prompts, greedy)]
  assert swapped == fresh and swapped != before
