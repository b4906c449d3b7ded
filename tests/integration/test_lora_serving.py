"""Serving LoRA adapters (serve_lora_adapters; checkpoint/lora_adapters.py, layers/lora_rows.py): two adapter runs
as train.py writes them (a: rank 4, alpha 8, read from its run folder; b: rank 2, alpha 4, from one checkpoint
step: padded to rank 4) over one base. Greedy output through an adapter equals that adapter merged into the base
(lora.merged) and served with none; a batch mixing a, b and none equals each request alone, with no step program
compiled for the adapters (the same count as a batch of base requests); the prefix cache never hands one adapter's
pages to another's request; each bad entry is one line naming it."""

import jax
import numpy as np
import pytest

from MaxText.checkpoint import lora_adapters, model_state
from MaxText.config.types import ConfigError
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.layers import lora
from MaxText.layers.linears import kernel_block
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.lora import write_adapter_run
from tests.support.serving import BASE, SYSTEM

PROMPTS = [[1, 99, 7], [5, 6, 7, 8, 9], [2, 40, 41, 42], [1, 2]]  # one chunk each: few step shapes
RANKS = {"a": (4, 8.0), "b": (2, 4.0)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(engine serving a and b, its own params, {name: params of the base with that adapter merged}, base params)."""
  tmp = tmp_path_factory.mktemp("lora_serving")
  base_cfg = make_config(**BASE)
  mesh = sharding.create_mesh(base_cfg)
  with jax.set_mesh(mesh):
    _, params, buffers, _ = model_state.create(base_cfg, mesh)
  model_state.save_parameters(str(tmp / "base"), params, buffers)
  adapters = {name: write_adapter_run(str(tmp), name, seed, **BASE, lora_rank=r, lora_alpha=alpha)
              for seed, (name, (r, alpha)) in enumerate(RANKS.items())}
  cfg = make_config(**BASE, load_parameters_path=str(tmp / "base"),
                    serve_lora_adapters=[f"a={tmp / 'a'}", f"b={tmp / 'b' / 'checkpoints' / '1'}"])
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    served_cfg, graphdef, slots, buffers, _ = lora_adapters.load_or_create(cfg, mesh)
    engine = ServingEngine(served_cfg, graphdef, slots, buffers, eos_id=-1)
  base = jax.tree.map(np.asarray, params)
  zero_slots = jax.tree.map(np.zeros_like, lora.split(jax.tree.map(np.asarray, slots))[0])
  merged = {name: lora.join(zero_slots, lora.merged(base, adapters[name], alpha / r, kernel_block(base_cfg)))
            for name, (r, alpha) in RANKS.items()}
  merged["none"] = lora.join(zero_slots, base)
  yield engine, slots, buffers, merged, tmp, cfg, mesh


def _greedy(engine, prompts, adapters) -> list[list[int]]:
  return [r.output for r in engine.generate(prompts, [SamplingParams(max_tokens=5, lora_adapter=k) for k in adapters])]


def test_greedy_output_with_an_adapter_equals_it_merged_into_the_base_served_alone(served):
  engine, slots, buffers, merged, *_ = served
  engine.load_weights(slots, buffers)
  got = {name: _greedy(engine, PROMPTS, [k] * len(PROMPTS)) for k, name in enumerate(("none", "a", "b"))}
  for name in ("none", "a", "b"):
    engine.load_weights(merged[name], buffers)  # the merged model, through slot 0 (zeros: adds nothing)
    assert _greedy(engine, PROMPTS, [0] * len(PROMPTS)) == got[name], name
  assert got["a"] != got["none"] and got["b"] != got["none"] and got["a"] != got["b"]  # the adapters are live


def test_a_mixed_batch_equals_each_request_alone_and_compiles_no_program_for_the_adapters(served):
  engine, slots, buffers, *_ = served
  engine.load_weights(slots, buffers)
  _greedy(engine, PROMPTS, [0] * len(PROMPTS))  # base requests only: the batch's step programs
  programs = engine.step_programs()
  mix = [1, 2, 0, 1]
  mixed = _greedy(engine, PROMPTS, mix)
  assert engine.step_programs() == programs  # a, b and none in one batch: the same programs
  alone = [_greedy(engine, [p], [k])[0] for p, k in zip(PROMPTS, mix)]
  assert mixed == alone


def test_the_prefix_cache_never_shares_pages_across_adapters(served):
  engine, slots, buffers, *_ = served
  engine.load_weights(slots, buffers)
  prompt = SYSTEM + [30, 31]  # one full page of SYSTEM, cached by the first request
  fresh_b = _greedy(engine, [prompt], [2])
  engine.load_weights(slots, buffers)  # empty cache
  _greedy(engine, [prompt], [1])
  hits = engine.allocator.hits
  assert _greedy(engine, [prompt], [2]) == fresh_b and engine.allocator.hits == hits  # a's page is not b's
  _greedy(engine, [prompt], [0])
  assert engine.allocator.hits == hits  # nor the base's
  _greedy(engine, [prompt], [1])
  assert engine.allocator.hits > hits  # a's own later request shares it


@pytest.mark.parametrize("entry,said", [
    ("c={tmp}/nowhere", "entry c={tmp}/nowhere: no such folder; give a LoRA run's folder"),
    ("c={tmp}/base", "entry c={tmp}/base: no config.yml of its run beside its checkpoints"),
    ("c={tmp}/q_only", "entry c={tmp}/q_only: adapts other linears than entry a \\(not: dense_layers"),
    ("c={tmp}/wide", "entry c={tmp}/wide: its dense_layers/layers/mlp/down/lora_a is \\[1, 96, 4\\] with lora_rank=4, "
                     "the served model's is \\[1, 128, r\\]: trained over another base"),
])
def test_a_bad_entry_is_one_line_naming_it(served, entry, said):
  *_, tmp, cfg, mesh = served
  if "q_only" in entry and not (tmp / "q_only").exists():
    write_adapter_run(str(tmp), "q_only", 3, **BASE, lora_rank=4, lora_module_path=".*/attention/wq_a")
  if "wide" in entry and not (tmp / "wide").exists():
    write_adapter_run(str(tmp), "wide", 4, **BASE, lora_rank=4, mlp_dim=96)
  bad = cfg.model_copy(update={"serve_lora_adapters": (cfg.serve_lora_adapters[0], entry.format(tmp=tmp))})
  with pytest.raises(ConfigError, match=said.format(tmp=tmp)) as e:
    lora_adapters.load_or_create(bad, mesh)
  assert "\n" not in str(e.value)
