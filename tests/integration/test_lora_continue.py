"""A LoRA run's adapters carried on, over the base they were trained over and no other: a new run started from an
SFT run's adapters (lora_restore_path) holds them bit for bit and gives the SFT model's logits at step 0, its GRPO
reference the base with the adapters off; every mismatch with the adapters' run (rank, alpha, modules, base) is one
line naming the key. A LoRA checkpoint records its base: a resume, a serve or a merged export over another base is
one line (exit 2) naming load_parameters_path and the base the run trained over, and nothing is lost (the run then
resumes over its own base, or over a copy of it elsewhere)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from MaxText import export_hf_checkpoint, train
from MaxText.checkpoint import hf_export, lora_adapters, model_state, orbax_state
from MaxText.config.types import ConfigError
from MaxText.layers import lora
from MaxText.post_train.reference import Reference
from MaxText.runtime import cli, sharding
from tests.support.lora import small_lora_config

RUN = dict(steps=2, checkpoint_period=2, async_checkpointing=False, enable_tensorboard=False, log_period=1,
           matmul_precision="highest")
TOKENS = np.random.default_rng(0).integers(3, 200, size=(2, 16))


def _save_base(path, seed, **keys):
  cfg = small_lora_config(lora_rank=0, seed=seed, **keys)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh):
    _, params, buffers, _ = model_state.create(cfg, mesh)
  model_state.save_parameters(str(path), params, buffers)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(tmp, the SFT run's config): bases b1 and b2 (another seed), and a LoRA run of 2 steps over b1 (checkpoint 2)."""
  tmp = tmp_path_factory.mktemp("lora_continue")
  _save_base(tmp / "b1", 0)
  _save_base(tmp / "b2", 1)
  cfg = small_lora_config(**RUN, base_output_directory=str(tmp), run_name="sft", load_parameters_path=str(tmp / "b1"))
  train.train(cfg)
  return tmp, cfg


def _init(cfg):
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, _, _ = train.init_state(cfg, mesh)
    logits = np.asarray(jax.jit(lambda p, b: model_state.merge(graphdef, p, b)(jnp.asarray(TOKENS))[0])(
        state["params"], train.model_buffers(state)))
    return graphdef, state, logits


def test_a_run_started_from_lora_adapters_holds_them_and_gives_their_logits_its_reference_the_base(runs):
  tmp, sft = runs
  saved = hf_export.restore_raw(str(tmp / "sft" / "checkpoints" / "2" / "state"))["params"]
  cfg = sft.model_copy(update={"run_name": "rl", "lora_restore_path": str(tmp / "sft")})
  graphdef, state, logits = _init(cfg)
  got = jax.tree.map(np.asarray, state["params"])
  assert jax.tree.structure(got) == jax.tree.structure(hf_export._int_keys(saved))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(hf_export._int_keys(saved))):
    assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
  # the SFT run's adapted model: its adapters over b1, merged by hand
  _, _, base_logits = _init(sft.model_copy(update={"run_name": "fresh"}))  # B = 0: the base's logits
  base, buffers = hf_export.restore_parameters(str(tmp / "b1"), cfg.model_copy(update={"lora_rank": 0}))
  plain = model_state.abstract_model(cfg.model_copy(update={"lora_rank": 0}))[0]
  merged = lora.merged(base, hf_export._int_keys(saved), cfg.lora_alpha / cfg.lora_rank, (16, 16))
  want = np.asarray(jax.jit(lambda p, b: model_state.merge(plain, p, b)(jnp.asarray(TOKENS))[0])(merged, buffers))
  assert np.abs(want - base_logits).max() > 1e-3  # the SFT adapters matter
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  # GRPO's reference (rl_beta > 0): the base with the adapters off, not the adapters it started from
  ref = Reference(cfg, graphdef, state, None)
  ref_logits = np.asarray(jax.jit(lambda p, b: model_state.merge(ref.graphdef, p, b)(jnp.asarray(TOKENS))[0])(
      *ref.weights(state)))
  np.testing.assert_array_equal(ref_logits, base_logits)


@pytest.mark.parametrize("keys,said", [
    (dict(lora_rank=2), "lora_restore_path={sft}: its run trained at lora_rank=4, this config has lora_rank=2: set "
                        "lora_rank=4"),
    (dict(lora_alpha=4.0), "its run trained at lora_alpha=16, this config has lora_alpha=4: set lora_alpha=16"),
    (dict(lora_module_path=".*/attention/wq_a"), "adapts other linears than lora_module_path='.*/attention/wq_a' "
                                                 r"\(also: dense_layers/layers/attention/indexer/weights_proj, dense_layers/layers/attention/indexer/wk"),
    (dict(load_parameters_path="{b2}"), "load_parameters_path={b2} is not the base lora_restore_path={sft} was trained "
                                        "over: load_parameters_path={b1} \\(base fingerprint 0x"),
    (dict(lora_restore_path="{tmp}/nowhere"), "lora_restore_path={tmp}/nowhere: no such folder"),
])
def test_starting_from_adapters_of_another_rank_alpha_modules_or_base_is_one_line_naming_the_key(runs, keys, said):
  tmp, sft = runs
  names = dict(sft=tmp / "sft", b1=tmp / "b1", b2=tmp / "b2", tmp=tmp)
  keys = {k: v.format(**names) if isinstance(v, str) else v for k, v in keys.items()}
  cfg = sft.model_copy(update={"run_name": "other", "lora_restore_path": str(tmp / "sft"), **keys})
  with pytest.raises(ConfigError, match=said.format(**names).replace("[", r"\[")) as e:
    _init(cfg)
  assert "\n" not in str(e.value)


def test_starting_from_adapters_of_another_models_shape_is_one_line_naming_the_key(runs):
  """Adapters of the same linears, rank and alpha but another model's widths (q_lora_rank 32 -> 48), the base check
  off (lora_check_base=false: a warning): restored()'s shape check is the line that stops it."""
  tmp, sft = runs
  wide = dict(q_lora_rank=48)
  _save_base(tmp / "b3", 0, **wide)
  cfg = sft.model_copy(update={"run_name": "wide", "lora_restore_path": str(tmp / "sft"), "lora_check_base": False,
                               "load_parameters_path": str(tmp / "b3"), **wide})
  with pytest.raises(ConfigError, match=rf"lora_restore_path={tmp / 'sft'}: its \S+ is \[\d+(, \d+)*\], this model's is "
                                        r"\[\d+(, \d+)*\]: trained over another model") as e:
    _init(cfg)
  assert "\n" not in str(e.value) and "48" in str(e.value)


def test_a_resume_over_another_base_is_one_line_and_loses_nothing(runs, capsys):
  tmp, sft = runs
  shutil.copytree(tmp / "sft", tmp / "resumed")
  more = dict(run_name="resumed", steps=4)
  with pytest.raises(SystemExit) as e:
    cli.run(lambda: train.train(sft.model_copy(update={**more, "load_parameters_path": str(tmp / "b2")})))
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "\n" not in err, err
  assert err.startswith(f"error: load_parameters_path={tmp / 'b2'} is not the base run_name=resumed's checkpoint "
                        f"step 2 ") and f"trained over: load_parameters_path={tmp / 'b1'} (base fingerprint" in err
  assert sorted(os.listdir(tmp / "resumed" / "checkpoints")) == ["2"]  # nothing set aside or written
  saved = yaml.safe_load(open(tmp / "resumed" / "config.yml"))
  assert saved["load_parameters_path"] == str(tmp / "b1")  # the run's config.yml still names its base (export reads it)
  # the same base copied elsewhere is the same base: the run resumes from step 2 and trains on
  shutil.copytree(tmp / "b1", tmp / "b1_copy")
  last = train.train(sft.model_copy(update={**more, "load_parameters_path": str(tmp / "b1_copy")}))
  assert "resumed from checkpoint step 2" in capsys.readouterr().out and np.isfinite(last["loss"])
  assert sorted(os.listdir(tmp / "resumed" / "checkpoints")) == ["2", "4"]
  record = orbax_state.step_base_record(str(tmp / "resumed" / "checkpoints" / "4"))
  assert record["load_parameters_path"] == str(tmp / "b1_copy")
  assert record["fingerprint"] == orbax_state.step_base_record(str(tmp / "sft" / "checkpoints" / "2"))["fingerprint"]


def test_serving_or_exporting_adapters_over_another_base_is_one_line(runs, tmp_path, capsys):
  tmp, sft = runs
  cfg = sft.model_copy(update={"lora_rank": 0, "load_parameters_path": str(tmp / "b2"),
                               "serve_lora_adapters": (f"a={tmp / 'sft'}",)})
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh), pytest.raises(ConfigError, match=(
      f"load_parameters_path={tmp / 'b2'} is not the base serve_lora_adapters entry a={tmp / 'sft'} was trained over: "
      f"load_parameters_path={tmp / 'b1'}")):
    lora_adapters.load_or_create(cfg, mesh)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):  # over its own base: served
    lora_adapters.load_or_create(cfg.model_copy(update={"load_parameters_path": str(tmp / "b1")}), mesh)
    capsys.readouterr()
    lora_adapters.load_or_create(cfg.model_copy(update={"lora_check_base": False}), mesh)  # the override: a warning
  warned = capsys.readouterr().err.strip()
  assert warned.startswith(f"warning: load_parameters_path={tmp / 'b2'} is not the base serve_lora_adapters entry")
  assert warned.endswith("used anyway (lora_check_base=false)") and "\n" not in warned
  args = ["--checkpoint", str(tmp / "sft" / "checkpoints"), "--output", str(tmp_path / "merged"), "--config",
          str(tmp / "sft" / "config.yml")]
  with pytest.raises(SystemExit) as e:  # the command line: one line, exit 2
    export_hf_checkpoint.main([*args, f"load_parameters_path={tmp / 'b2'}"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "\n" not in err and err.startswith(
      f"error: load_parameters_path={tmp / 'b2'} is not the base --checkpoint "), err
  export_hf_checkpoint.main(args)  # over its own base
  assert os.path.isfile(tmp_path / "merged" / "config.json")


def test_the_base_fingerprint_is_the_same_for_float32_and_bfloat16_loads_and_changes_with_one_weight():
  rng = np.random.default_rng(0)
  base = {"a": {"kernel": rng.standard_normal((8, 16)).astype(np.float32)}, "b": np.arange(5, dtype=np.int32)}
  f32 = int(orbax_state.base_fingerprint(base))
  assert f32 == int(orbax_state.base_fingerprint(jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.dtype == np.float32 else x, base)))
  other = jax.tree.map(np.copy, base)
  other["a"]["kernel"][3, 5] += 0.5
  assert int(orbax_state.base_fingerprint(other)) != f32
