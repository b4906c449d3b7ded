"""HF export, the inverse of the importer: HF -> import -> export reproduces every tensor (names and values,
MTP layer included, sharded with an index) and config.json; a training run's checkpoint exports to an HF
model whose logits equal ours; bad input exits with one line; both converters answer --help."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from MaxText import convert_hf_checkpoint, export_hf_checkpoint, train  # noqa: E402
from MaxText.checkpoint import hf_export, hf_format, hf_import, model_state
from tests.conftest import REPO_ROOT, make_config  # noqa: E402
from tests.support.hf_reference import build_hf_model, make_fp8_checkpoint  # noqa: E402


def _add_mtp_layer(hf_dir):
  """Appends an MTP module as DeepSeek's checkpoints hold it (layer N: enorm, hnorm, eh_proj, shared_head.norm,
  a MoE layer, and copies of the embedding and head); transformers' save_pretrained drops it."""
  cfg_path = os.path.join(hf_dir, "config.json")
  hf_cfg = json.load(open(cfg_path))
  n, d = hf_cfg["num_hidden_layers"], hf_cfg["hidden_size"]
  path = os.path.join(hf_dir, "model.safetensors")
  sd = load_file(path)
  g = torch.Generator().manual_seed(7)
  last = f"model.layers.{n - 1}."
  for name, w in list(sd.items()):
    if name.startswith(last):
      sd[f"model.layers.{n}." + name[len(last):]] = 0.1 * torch.randn(w.shape, generator=g)
  p = f"model.layers.{n}."
  sd.update({p + "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
             p + "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
             p + "eh_proj.weight": 0.1 * torch.randn(d, 2 * d, generator=g),
             p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
             p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
             p + "shared_head.head.weight": sd["lm_head.weight"].clone()})
  save_file(sd, path, metadata={"format": "pt"})
  hf_cfg["num_nextn_predict_layers"] = 1
  json.dump(hf_cfg, open(cfg_path, "w"), indent=2)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF folder, our converter output) of a tiny random DeepSeek-V3.2 with one MTP layer, scanned layers."""
  root = tmp_path_factory.mktemp("export")
  build_hf_model().save_pretrained(root / "hf")
  _add_mtp_layer(str(root / "hf"))
  hf_import.convert_checkpoint(str(root / "hf"), str(root / "ours"))
  return str(root / "hf"), str(root / "ours")


def _export(capsys, *args):
  export_hf_checkpoint.main([str(a) for a in args])
  out = capsys.readouterr().out.strip().splitlines()
  assert out[-1].startswith("exported "), out


def _read_export(folder):
  """Every tensor of an export, checking the index names each tensor's file and every file is listed."""
  files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  tensors, where = {}, {}
  for f in files:
    for name, t in load_file(os.path.join(folder, f)).items():
      tensors[name], where[name] = t, f
  if len(files) > 1:
    index = json.load(open(os.path.join(folder, hf_format.INDEX_FILE)))
    assert index["weight_map"] == where
  return tensors, files


def test_hf_import_export_reproduces_every_tensor_and_the_config(converted, tmp_path, capsys):
  # One table serves both directions, so a name mapped to the wrong tensor of ours both ways (gate and
  # up swapped) round-trips unseen here: test_hf_parity's logits (fast, unmarked) are what catch it.
  hf_dir, ours = converted
  original = load_file(os.path.join(hf_dir, "model.safetensors"))
  _export(capsys, "--checkpoint", ours, "--output", tmp_path / "f32", "--dtype", "float32",
          "--max-shard-size", "100KB")
  exported, files = _read_export(tmp_path / "f32")
  assert len(files) > 3 and all(os.path.getsize(tmp_path / "f32" / f) <= 100_000 + 4096 for f in files)
  assert sorted(exported) == sorted(original)
  for name, t in original.items():
    assert exported[name].dtype == torch.float32, name
    assert torch.equal(exported[name], t), name

  _export(capsys, "--checkpoint", ours, "--output", tmp_path / "bf16")  # default bfloat16, one file
  exported, files = _read_export(tmp_path / "bf16")
  assert files == ["model.safetensors"] and sorted(exported) == sorted(original)
  for name, t in original.items():
    want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
    assert exported[name].dtype == want, name
    assert torch.equal(exported[name], t.to(want)), name

  theirs, back = (json.load(open(os.path.join(d, "config.json"))) for d in (hf_dir, tmp_path / "f32"))
  assert back["architectures"] == ["DeepseekV32ForCausalLM"] and back["model_type"] == theirs["model_type"]
  for _, key, _ in hf_format.CONFIG_KEYS:
    assert back[key] == theirs[key], key
  assert back["rope_parameters"] == theirs["rope_parameters"]  # mscale and mscale_all_dim included
  assert hf_format.config_from_hf(back) == hf_format.config_from_hf(theirs)
  a, b = (transformers.AutoConfig.from_pretrained(d) for d in (hf_dir, tmp_path / "f32"))
  assert type(b) is type(a)
  for _, key, _ in hf_format.CONFIG_KEYS:
    assert getattr(b, key) == getattr(a, key), key


def test_fp8_checkpoint_round_trips_bit_exact_with_weight_quantization_fp8_block(tmp_path, capsys):
  """DeepSeek's fp8 layout (e4m3 + weight_scale_inv per [32, 16] block, bf16 elsewhere, MTP layer included)
  -> convert with weight_quantization=fp8_block (kept in fp8, not dequantized) -> export: the same bytes."""
  build_hf_model().save_pretrained(tmp_path / "hf")
  _add_mtp_layer(str(tmp_path / "hf"))
  make_fp8_checkpoint(str(tmp_path / "hf"), (32, 16))
  convert_hf_checkpoint.main(["--hf-path", str(tmp_path / "hf"), "--output", str(tmp_path / "ours"),
                              "weight_quantization=fp8_block"])
  stored = hf_export.restore_raw(str(tmp_path / "ours"))["params"]
  wq_b = stored["moe_layers"]["layers"]["attention"]["wq_b"]
  assert wq_b["kernel"].dtype == jnp.float8_e4m3fn and wq_b["kernel_scale"].dtype == np.float32
  assert stored["moe_layers"]["layers"]["mlp"]["wi_0"].dtype == jnp.float8_e4m3fn

  _export(capsys, "--checkpoint", tmp_path / "ours", "--output", tmp_path / "out")  # bfloat16 for the rest
  original = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
  exported, _ = _read_export(tmp_path / "out")
  assert sorted(exported) == sorted(original)
  assert sum(t.dtype == torch.float8_e4m3fn for t in original.values()) > 50
  for name, t in original.items():
    assert exported[name].dtype == t.dtype, name
    assert exported[name].shape == t.shape and torch.equal(exported[name].view(torch.uint8), t.view(torch.uint8)), name
  theirs, back = (json.load(open(os.path.join(d, "config.json"))) for d in (tmp_path / "hf", tmp_path / "out"))
  assert back["quantization_config"] == theirs["quantization_config"]


def _logits_hf(folder, tokens):
  model, info = transformers.DeepseekV32ForCausalLM.from_pretrained(str(folder), output_loading_info=True)
  assert not info["missing_keys"] and not info["mismatched_keys"], info
  model.eval().config._attn_implementation = "eager"
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_training_checkpoint_exports_to_hf_with_equal_logits(tmp_path, capsys):
  # A large bias step so that the trained routing biases change which experts are chosen; 16 indexer
  # heads so that no two keys tie at an all-zero relu score (ties may break either way in HF's top-k).
  run = dict(base_output_directory=str(tmp_path), run_name="run", steps=2, checkpoint_period=1, warmup_steps=1,
             log_period=1, enable_tensorboard=False, async_checkpointing=False, routed_bias_update_rate=0.3)
  train.train(make_config(**run, indexer_n_heads=16))
  ckpts = tmp_path / "run" / "checkpoints"
  assert sorted(os.listdir(ckpts)) == ["1", "2"]
  _export(capsys, "--checkpoint", ckpts, "--output", tmp_path / "hf", "--config", "base.yml", "--dtype", "float32",
          "indexer_n_heads=16")

  cfg = make_config(matmul_precision="highest", indexer_n_heads=16)
  params, buffers = hf_export.restore_parameters(str(ckpts / "2"), cfg)  # the newest step
  assert np.abs(buffers["moe_layers"]["layers"]["mlp"]["routing_bias"]).max() > 0.1
  graphdef, _, _ = model_state.abstract_model(cfg)
  tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 40))
  forward = jax.jit(lambda p, b, x: model_state.merge(graphdef, p, b)(x)[0])  # [b,t,V]; eager takes ~4x longer
  ours = np.asarray(forward(params, buffers, jnp.asarray(tokens)))
  theirs = _logits_hf(tmp_path / "hf", tokens)
  rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  assert rel <= 1e-5, rel

  # One step folder: that step's weights (step 1 = init: its learning rate is 0), not the newest.
  _export(capsys, "--checkpoint", ckpts / "1", "--output", tmp_path / "hf1", "--config", "base.yml",
          "indexer_n_heads=16")
  step1, _ = hf_export.restore_parameters(str(ckpts / "1"), cfg)
  embed = load_file(str(tmp_path / "hf1" / "model.safetensors"))["model.embed_tokens.weight"]
  assert torch.equal(embed, torch.as_tensor(step1["embed"]["embedding"]).to(torch.bfloat16))
  assert not np.array_equal(step1["embed"]["embedding"], params["embed"]["embedding"])


def _error_line(capsys, *args):
  with pytest.raises(SystemExit) as e:
    export_hf_checkpoint.main([str(a) for a in args])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "\n" not in err, err
  return err


def test_bad_input_exits_with_one_line_naming_the_path(converted, tmp_path, capsys):
  _, ours = converted
  missing = tmp_path / "nope"
  err = _error_line(capsys, "--checkpoint", missing, "--output", tmp_path / "o")
  assert str(missing) in err and "no such folder" in err and "checkpoints/<step>" in err
  (tmp_path / "empty").mkdir()
  err = _error_line(capsys, "--checkpoint", tmp_path / "empty", "--output", tmp_path / "o", "--config", "base.yml")
  assert "empty: not a checkpoint" in err
  (tmp_path / "file").write_text("")
  err = _error_line(capsys, "--checkpoint", ours, "--output", tmp_path / "file" / "sub")
  assert f"--output {tmp_path / 'file' / 'sub'}: cannot create it" in err and "writable" in err
  err = _error_line(capsys, "--checkpoint", ours, "--output", tmp_path / "o", "emb_dim=32")
  assert "does not match the configured model" in err
  (tmp_path / "run" / "checkpoints" / "5" / "state").mkdir(parents=True)
  err = _error_line(capsys, "--checkpoint", tmp_path / "run", "--output", tmp_path / "o")
  assert "no model.yml: give --config" in err
  # The real command line: one line on stderr, no traceback.
  p = subprocess.run([sys.executable, "-m", "MaxText.export_hf_checkpoint", "--checkpoint", str(missing),
                      "--output", str(tmp_path / "o")], cwd=REPO_ROOT, capture_output=True, text=True)
  assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("module,flag", [(convert_hf_checkpoint, "--help"), (export_hf_checkpoint, "-h")])
def test_help_gives_usage_the_key_value_convention_and_where_keys_are_documented(module, flag, capsys):
  with pytest.raises(SystemExit) as e:
    module.main([flag])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: python -m {module.__name__}")
  assert "key=value" in out and "configs/base.yml" in out


def _lora_run(ours, tmp_path, **keys):
  """(config, base params, adapters, buffers) of a LoRA run over the converter output `ours` whose adapters are
  saved as a checkpoint in tmp_path/adapters: A as initialized, B random (B = 0 would export a no-op)."""
  from MaxText.layers import lora
  overrides = [f"{k}={v}" for k, v in dict(lora_rank=4, lora_alpha=8.0, load_parameters_path=ours,
                                           matmul_precision="highest", **keys).items()]
  cfg = hf_export.export_config(ours, None, overrides)
  base, buffers = hf_export.restore_parameters(ours, cfg.model_copy(update={"lora_rank": 0}))
  graphdef, abstract, _ = model_state.abstract_model(cfg)
  adapters = lora.split(abstract.to_pure_dict())[0]
  leaves, treedef = jax.tree.flatten(adapters)
  keys_ = jax.random.split(jax.random.key(3), len(leaves))
  adapters = jax.tree.unflatten(treedef, [np.asarray(0.3 * jax.random.normal(k, a.shape), np.float32)
                                          for k, a in zip(keys_, leaves)])
  model_state.save_parameters(str(tmp_path / "adapters"), adapters, {})
  return cfg, graphdef, base, adapters, buffers, overrides


@pytest.mark.parametrize("experts", ["wi_0|wi_1|wo", "wi_1"])
def test_peft_adapter_over_transformers_gives_our_lora_logits(converted, tmp_path, capsys, experts):
  """--lora peft: peft's PeftModel over transformers' DeepseekV32ForCausalLM (the HF folder the converter read)
  with our exported adapter_config.json + adapter_model.safetensors gives the adapted model's logits (1e-4);
  the default modules, the indexer's and the routed experts' (all three weights: gate and up as one rank-2r
  ParamWrapper over the fused gate_up_proj, down_proj nested outside it; or up alone), with the MTP layer's adapters
  left out. The same adapters merged (hf_export.restore_parameters of the LoRA run, what --lora merged writes) give
  those logits too."""
  peft = pytest.importorskip("peft")
  hf_dir, ours = converted
  regex = ("'.*/attention/(wq_a|wq_b|wkv_a|wkv_b|wo)|.*/mlp(/shared_experts)?/(gate|up|down)|.*/indexer/(wq_b|wk)"
           f"|.*/mlp/({experts})'")
  cfg, graphdef, base, adapters, buffers, overrides = _lora_run(ours, tmp_path, lora_module_path=regex)
  _export(capsys, "--checkpoint", tmp_path / "adapters", "--output", tmp_path / "peft", "--lora", "peft",
          "--config", os.path.join(ours, hf_export.CONFIG_FILE), *overrides)
  assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
  conf = json.load(open(tmp_path / "peft" / "adapter_config.json"))
  assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and "model.layers.1.self_attn.indexer.wk" in conf["target_modules"]
  assert not any(m.startswith("model.layers.3.") for m in conf["target_modules"] + conf["target_parameters"])  # MTP
  fused = "model.layers.1.mlp.experts.gate_up_proj" in conf["target_parameters"]
  assert fused and ("model.layers.1.mlp.experts.down_proj" in conf["target_parameters"]) == (experts != "wi_1")
  fused_2r = {rf"model\.layers\.{i}\.mlp\.experts\.gate_up_proj": 8 for i in (1, 2)}  # gate and up: rank 2r
  assert conf["rank_pattern"] == (fused_2r if experts != "wi_1" else {})

  tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, size=(2, 24))
  from MaxText.layers import lora
  forward = jax.jit(lambda p, b, x: model_state.merge(graphdef, p, b)(x)[0])  # [b,t,V]
  ours_logits = np.asarray(forward(lora.join(adapters, base), buffers, jnp.asarray(tokens)))
  base_logits = np.asarray(forward(lora.join(jax.tree.map(np.zeros_like, adapters), base), buffers,
                                   jnp.asarray(tokens)))
  model = transformers.DeepseekV32ForCausalLM.from_pretrained(hf_dir)
  model.config._attn_implementation = "eager"
  model = peft.PeftModel.from_pretrained(model, str(tmp_path / "peft")).eval()
  with torch.no_grad():
    theirs = model(torch.as_tensor(tokens)).logits.numpy()
  assert np.abs(ours_logits - base_logits).max() > 0.1  # the adapters matter
  np.testing.assert_allclose(theirs, ours_logits, rtol=1e-4, atol=1e-4)
  # --lora merged's tree (restore_parameters of a LoRA run): the model without adapters gives the same logits
  plain_cfg = cfg.model_copy(update={"lora_rank": 0})
  merged_params, merged_buffers = hf_export.restore_parameters(str(tmp_path / "adapters"), cfg)
  plain = jax.jit(lambda p, b, x: model_state.merge(model_state.abstract_model(plain_cfg)[0], p, b)(x)[0])
  np.testing.assert_allclose(np.asarray(plain(merged_params, merged_buffers, jnp.asarray(tokens))), ours_logits,
                             rtol=1e-4, atol=1e-4)


def test_lora_export_refusals_are_one_line(converted, tmp_path, capsys):
  _, ours = converted
  err = _error_line(capsys, "--checkpoint", ours, "--output", tmp_path / "o", "--lora", "peft")
  assert "--lora peft: the model has lora_rank=0" in err


def test_merged_float_over_an_fp8_base_writes_a_float_model_whose_logits_are_the_adapted_models(tmp_path, capsys):
  """--lora merged-float over DeepSeek's fp8 layout: config.json without quantization_config, every tensor float32
  (--dtype float32), and transformers over it gives our adapted model's logits (the base dequantized, the adapters
  merged in fp32); --lora merged writes e4m3 blocks again."""
  build_hf_model().save_pretrained(tmp_path / "hf")
  make_fp8_checkpoint(str(tmp_path / "hf"), (32, 16))
  ours = str(tmp_path / "ours")
  convert_hf_checkpoint.main(["--hf-path", str(tmp_path / "hf"), "--output", ours, "weight_quantization=fp8_block"])
  cfg, graphdef, base, adapters, buffers, overrides = _lora_run(ours, tmp_path)
  for fmt in ("merged", "merged-float"):
    _export(capsys, "--checkpoint", tmp_path / "adapters", "--output", tmp_path / fmt, "--lora", fmt, "--dtype",
            "float32", "--config", os.path.join(ours, hf_export.CONFIG_FILE), *overrides)
  written = {fmt: _read_export(tmp_path / fmt)[0] for fmt in ("merged", "merged-float")}
  assert written["merged"]["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
  assert all(t.dtype == torch.float32 for t in written["merged-float"].values())
  conf = json.load(open(tmp_path / "merged-float" / "config.json"))
  assert "quantization_config" not in conf
  tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, size=(2, 24))
  from MaxText.layers import lora
  forward = jax.jit(lambda p, b, x: model_state.merge(graphdef, p, b)(x)[0])  # [b,t,V]
  ours_logits = np.asarray(forward(lora.join(adapters, base), buffers, jnp.asarray(tokens)))
  theirs = _logits_hf(tmp_path / "merged-float", tokens)
  np.testing.assert_allclose(theirs, ours_logits, rtol=1e-4, atol=1e-4)
