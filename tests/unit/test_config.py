"""pyconfig + types: resolution, merge order, override typing, every error class, frozen-ness."""

import os
import subprocess
import sys

import pydantic
import pytest
import yaml

from MaxText.config import pyconfig
from MaxText.config.types import Config, ConfigError, schema_keys

REPO = pyconfig.REPO_ROOT


def init(*args, num_devices=1, **kw):
  return pyconfig.initialize(["prog", *args], num_devices=num_devices, **kw)


def test_base_yml_and_schema_have_the_same_keys():
  with open(pyconfig.BASE_YML) as f:
    base = yaml.safe_load(f)
  assert set(base) == schema_keys(), (
      f"only in base.yml: {sorted(set(base) - schema_keys())}; only in types.py: {sorted(schema_keys() - set(base))}")


def test_schema_declares_no_defaults():
  with_default = [k for k, f in Config.model_fields.items() if not f.is_required()]
  assert with_default == [], f"defaults belong in base.yml, not types.py: {with_default}"


def test_every_base_key_has_a_comment():
  with open(pyconfig.BASE_YML) as f:
    lines = [l for l in f if l and not l.startswith((" ", "#", "\n"))]
  uncommented = [l.split(":")[0] for l in lines if "#" not in l]
  assert uncommented == []


def test_bare_name_and_path_resolve_to_the_same_config():
  a = init("base.yml")
  b = init(os.path.join(REPO, "configs", "base.yml"))
  c = init("base")
  assert a == b == c


def test_missing_config_file_is_named():
  with pytest.raises(ConfigError, match="nope.yml"):
    init("nope.yml")


def test_default_model_is_tiny_and_model_merge_applies():
  cfg = init("base.yml")
  assert cfg.model_name == "deepseek3.2-tiny"
  big = init("base.yml", "model_name=deepseek3.2-671b")
  assert (big.emb_dim, big.num_decoder_layers, big.first_num_dense_layers) == (7168, 61, 3)
  assert (big.num_experts, big.indexer_topk, big.indexer_n_heads, big.vocab_size) == (256, 2048, 64, 129280)
  assert big.num_moe_layers == 58 and big.qk_head_dim == 192


def test_cli_overrides_win_over_the_model_file_and_kwargs_win_over_cli():
  cfg = init("base.yml", "model_name=deepseek3.2-671b", "indexer_topk=512")
  assert cfg.indexer_topk == 512
  cfg = init("base.yml", "indexer_topk=512", indexer_topk=7)
  assert cfg.indexer_topk == 7


def test_cli_override_values_use_yaml_typing():
  cfg = init("base.yml", "indexer_use_approx_top_k=true", "indexer_approx_top_k_recall=0.99",
             "learning_rate=1e-4", "mesh_axes=[fsdp,data,context,tensor,expert]", "run_name=123")
  assert cfg.indexer_use_approx_top_k is True
  assert cfg.indexer_approx_top_k_recall == pytest.approx(0.99)
  assert cfg.learning_rate == pytest.approx(1e-4)
  assert cfg.mesh_axes == ("fsdp", "data", "context", "tensor", "expert")
  assert cfg.run_name == "123"


def test_one_column_name_is_a_one_column_list():
  assert init("base.yml", "train_data_columns=text").train_data_columns == ("text",)
  assert init("base.yml", "train_data_columns=[text]").train_data_columns == ("text",)


def test_a_yaml_path_layers_over_base(tmp_path):
  p = tmp_path / "mine.yml"
  p.write_text("indexer_topk: 5\nsteps: 3\n")
  cfg = init(str(p))
  assert (cfg.indexer_topk, cfg.steps, cfg.emb_dim) == (5, 3, 64)
  p.write_text("indexer_tpok: 5\n")
  with pytest.raises(ConfigError, match="indexer_tpok.*did you mean 'indexer_topk'"):
    init(str(p))


def test_unknown_key_names_the_nearest_valid_key():
  with pytest.raises(ConfigError, match="'indexer_use_aprox_top_k'.*did you mean 'indexer_use_approx_top_k'"):
    init("base.yml", "indexer_use_aprox_top_k=true")
  with pytest.raises(ConfigError, match="unknown config key 'zzzz'"):
    init("base.yml", zzzz=1)


def test_a_logical_axis_rule_for_a_name_no_layer_uses_is_refused():
  rules = [list(r) for r in yaml.safe_load(open(pyconfig.BASE_YML))["logical_axis_rules"]]
  vocab = [r for r in rules if r[0] == "vocab"][0]
  vocab[1] = ["tensor", "expert"]
  assert dict(init("base.yml", f"logical_axis_rules={rules}").logical_axis_rules)["vocab"] == ("tensor", "expert")
  vocab[0] = "vocabx"
  with pytest.raises(ConfigError, match="logical_axis_rules maps 'vocabx'.*known names.*vocab"):
    init("base.yml", f"logical_axis_rules={rules}")
  assert init("base.yml", f"logical_axis_rules={rules[:3]}").logical_axis_rules[0][0] == "activation_batch"


def test_malformed_override_is_refused():
  with pytest.raises(ConfigError, match="'indexer_topk' is not of the form key=value"):
    init("base.yml", "indexer_topk")


@pytest.mark.parametrize("arg,key,allowed", [
    ("indexer_approx_top_k_recall=1.5", "indexer_approx_top_k_recall", "less than or equal to 1"),
    ("indexer_approx_top_k_recall=0", "indexer_approx_top_k_recall", "greater than 0"),
    ("indexer_topk=0", "indexer_topk", "greater than or equal to 1"),
    ("indexer_topk=abc", "indexer_topk", "valid integer"),
    ("dtype=float16", "dtype", "'float32' or 'bfloat16'"),
    ("use_indexer=maybe", "use_indexer", "valid boolean"),
])
def test_bad_value_names_key_value_and_what_is_allowed(arg, key, allowed):
  with pytest.raises(ConfigError) as e:
    init("base.yml", arg)
  msg = str(e.value)
  assert key in msg and arg.split("=")[1] in msg and allowed in msg, msg


@pytest.mark.parametrize("overrides,names", [
    (dict(qk_rope_head_dim=7), ["qk_rope_head_dim", "even"]),
    (dict(indexer_head_dim=15), ["indexer_head_dim", "even"]),
    (dict(attention_type="mha"), ["use_indexer", "attention_type"]),
    (dict(q_lora_rank=0), ["use_indexer", "q_lora_rank"]),
    (dict(first_num_dense_layers=9), ["first_num_dense_layers", "num_decoder_layers"]),
    (dict(num_experts=6), ["num_experts", "n_routing_groups"]),
    (dict(max_prefill_length=100), ["max_prefill_length", "max_target_length"]),
    (dict(use_indexer=False, indexer_training_stage="dense_warmup"), ["dense_warmup", "use_indexer=true"]),
    (dict(moe_capacity_factor=0.5), ["moe_capacity_factor=0.5", "-1 (dropless)", ">= 1"]),
    (dict(moe_capacity_factor=0.0), ["moe_capacity_factor=0.0"]),
    (dict(num_devices=3, ici_expert_parallelism=3), ["num_experts=8", "ici_expert_parallelism=3"]),
])
def test_incompatible_combinations_name_both_keys(overrides, names):
  with pytest.raises(ConfigError) as e:
    init("base.yml", **overrides)
  for n in names:
    assert n in str(e.value), str(e.value)


def test_mesh_product_must_match_device_count():
  with pytest.raises(ConfigError, match="ici_fsdp_parallelism=2.*multiply to 8, but there are 4 devices"):
    init("base.yml", num_devices=4, ici_data_parallelism=4, ici_fsdp_parallelism=2)
  with pytest.raises(ConfigError, match="ici_tensor_parallelism=3.*do not divide the 8 devices"):
    init("base.yml", num_devices=8, ici_tensor_parallelism=3)


def test_minus_one_fills_the_mesh_from_the_device_count():
  cfg = init("base.yml", num_devices=8, ici_fsdp_parallelism=2)
  assert cfg.mesh_shape == {"stage": 1, "data": 4, "fsdp": 2, "context": 1, "tensor": 1, "expert": 1}


def test_sequence_must_divide_the_context_degree():
  with pytest.raises(ConfigError, match="max_target_length=60.*ici_context_parallelism=4"):
    init("base.yml", num_devices=4, ici_data_parallelism=1, ici_context_parallelism=4,
         max_target_length=60, max_prefill_length=8)
  # With load balancing the sequence splits into 2*cp chunks.
  with pytest.raises(ConfigError, match="max_target_length=36 is not divisible by 8.*load_balance"):
    init("base.yml", num_devices=4, ici_data_parallelism=1, ici_context_parallelism=4,
         max_target_length=36, max_prefill_length=8)
  cfg = init("base.yml", num_devices=4, ici_data_parallelism=1, ici_context_parallelism=4,
             max_target_length=36, max_prefill_length=8, context_parallel_load_balance=False)
  assert cfg.ici_context_parallelism == 4


def test_batch_must_divide_the_batch_shards():
  with pytest.raises(ConfigError, match="global_batch_size=6.*8 batch shards"):
    init("base.yml", num_devices=8, global_batch_size=6)


def test_config_is_frozen_and_hashable():
  cfg = init("base.yml")
  with pytest.raises(pydantic.ValidationError):
    cfg.indexer_topk = 3
  assert hash(cfg) == hash(init("base.yml"))


def test_the_671b_config_builds_from_its_file():
  cfg = init("base.yml", model_name="deepseek3.2-671b")
  assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 1.0 * __import__("math").log(40.0) + 1) ** 2)


@pytest.mark.parametrize("entry", [["-m", "MaxText.config"], ["MaxText/decode.py"]])
def test_cli_typo_exits_nonzero_with_one_line_and_no_traceback(entry):
  r = subprocess.run([sys.executable, *entry, "base.yml", "indexer_use_aprox_top_k=true"], cwd=REPO,
                     capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2
  assert "did you mean 'indexer_use_approx_top_k'" in r.stderr
  assert "Traceback" not in r.stderr


def test_a_resumed_retrieval_run_keeps_its_retrieval_keys_and_other_data_ignores_them(tmp_path, tiny_config):
  """The synthetic_retrieval keys decide the batches: a resume that changes one is refused in one
  line naming it; with another dataset_type they are not data keys and a resume may change them."""
  from MaxText.checkpoint.run_folder import ResumeMismatchError, RunFolder

  make_config = tiny_config
  for dataset_type, refused in (("synthetic_retrieval", True), ("synthetic", False)):
    out = str(tmp_path / dataset_type)
    RunFolder(make_config(base_output_directory=out, dataset_type=dataset_type)).write_config()
    resumed = RunFolder(make_config(base_output_directory=out, dataset_type=dataset_type, retrieval_values=8))
    if refused:
      with pytest.raises(ResumeMismatchError, match="retrieval_values=16 in the run, 8 now"):
        resumed.check_same_run(latest_step=3)
    else:
      resumed.check_same_run(latest_step=3)


def test_a_run_folders_config_yml_reads_the_same_files_from_any_directory(tmp_path, monkeypatch):
  from MaxText.checkpoint.run_folder import RunFolder
  from MaxText.data.tokenizer import load_tokenizer
  monkeypatch.chdir(REPO)
  config = init("base.yml", tokenizer_type="hf", tokenizer_path="tests/data/tokenizer.json",
                base_output_directory=str(tmp_path), run_name="r", dataset_path="tests/data/corpus.jsonl",
                grain_train_files="tests/data/a*.parquet,tests/data/b")
  RunFolder(config).write_config()
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  served = init(str(tmp_path / "r" / "config.yml"))
  assert served.tokenizer_path == os.path.join(REPO, "tests/data/tokenizer.json")
  assert served.grain_train_files == f"{REPO}/tests/data/a*.parquet,{REPO}/tests/data/b"
  assert served.jax_cache_dir == config.jax_cache_dir  # "~/..." as it was
  assert load_tokenizer(served).vocab_size == 391
  monkeypatch.chdir(REPO)
  RunFolder(config).check_same_run(1)  # the relative keys still name the run's files: a resume is allowed
  (tmp_path / "r" / "config.yml").write_text(pyconfig.to_yaml(config))  # a run written before: relative
  RunFolder(config).check_same_run(1)


OPTIMIZER_KEYS = ("learning_rate", "warmup_steps", "cosine_learning_rate_final_fraction", "adam_b1", "adam_b2",
                  "adam_weight_decay", "gradient_clipping_threshold")


@pytest.mark.parametrize("model", ["deepseek3.2-v5e", "deepseek3.2-671b"])
def test_a_model_file_of_real_size_carries_the_optimizer_that_size_trains_with(model):
  """base.yml's optimizer is the 0.4M-parameter tiny model's (peak 3e-3 in 10 steps): a file of real width sets its
  own (DeepSeek-V3's AdamW, peak 2.2e-4 after a warm-up, clipping on), so train.py with its defaults does not
  diverge (the v5e file under base.yml's: loss 12.1 -> 101 in 20 steps on a v5e)."""
  with open(os.path.join(REPO, "configs", "models", f"{model}.yml")) as f:
    own = yaml.safe_load(f)
  assert set(OPTIMIZER_KEYS) <= set(own), sorted(set(OPTIMIZER_KEYS) - set(own))
  cfg = init("base.yml", f"model_name={model}")
  base = init("base.yml")
  assert cfg.learning_rate == pytest.approx(2.2e-4) and cfg.learning_rate < base.learning_rate / 10
  assert cfg.warmup_steps >= 2 * base.warmup_steps and cfg.gradient_clipping_threshold == 1.0
  assert (cfg.adam_b1, cfg.adam_b2, cfg.adam_weight_decay) == (0.9, 0.95, 0.1)
