"""Whole-model parity with Hugging Face's DeepseekV32ForCausalLM through the checkpoint converter:
logits over the whole sequence (fp32, rel err <= 1e-4) and each layer's top-k selection, with
index_topk smaller than the sequence; plus an fp8 (e4m3, 128x128 block scales) checkpoint, and a
config.json whose every mapped key differs from base.yml (each must reach our Config).

These logits tests are the only ones that see a tensor-name mistake made in both directions (gate_proj
and up_proj swapped in hf_format's one table: import and export agree, so test_export_hf's round
trip reproduces every tensor anyway): keep them fast, out of the `slow` mark."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from MaxText.checkpoint import (
  hf_import,  # noqa: E402
  model_state,
)
from MaxText.config import pyconfig
from MaxText.layers.attention_mla import capture_selection
from tests.support.hf_reference import TOPK, build_hf_model, hf_config, make_fp8_checkpoint  # noqa: E402

SEQ = 40


# Every config.json key the converter maps, off base.yml's (and the tiny model's) value.
# rms_norm_eps is large enough that MLA's fixed latent-norm eps (1e-6) shows in the logits.
OFF_BASE = dict(
    vocab_size=300, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    first_k_dense_replace=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2,
    n_routed_experts=12, num_experts_per_tok=3, n_group=6, topk_group=3, routed_scaling_factor=1.7,
    norm_topk_prob=False, kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=4, v_head_dim=10,
    qk_nope_head_dim=12, index_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-2,
    rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
                     "original_max_position_embeddings": 16, "beta_fast": 16.0, "beta_slow": 2.0,
                     "mscale": 0.7, "mscale_all_dim": 0.7},
)
# our key <- its config.json key (a path into rope_parameters for YaRN): the converter's whole mapping.
MAPPED = {
    "vocab_size": "vocab_size", "emb_dim": "hidden_size", "mlp_dim": "intermediate_size",
    "num_decoder_layers": "num_hidden_layers", "first_num_dense_layers": "first_k_dense_replace",
    "normalization_layer_epsilon": "rms_norm_eps", "num_query_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "max_position_embeddings": "max_position_embeddings", "indexer_n_heads": "index_n_heads",
    "indexer_head_dim": "index_head_dim", "indexer_topk": "index_topk", "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok", "n_routing_groups": "n_group", "topk_routing_group": "topk_group",
    "shared_experts": "n_shared_experts", "moe_mlp_dim": "moe_intermediate_size",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "mtp_num_layers": "num_nextn_predict_layers", "rope_max_timescale": ("rope_parameters", "rope_theta"),
    "rope_factor": ("rope_parameters", "factor"),
    "original_max_position_embeddings": ("rope_parameters", "original_max_position_embeddings"),
    "beta_fast": ("rope_parameters", "beta_fast"), "beta_slow": ("rope_parameters", "beta_slow"),
    "mscale": ("rope_parameters", "mscale_all_dim"),
}
NOT_FROM_HF = {"use_indexer": True, "rope_type": "yarn"}  # fixed by the converter, not read from config.json


def hf_forward(model, tokens):
  """Logits and each layer's selected keys as bool [b,t,s] (causal keys only)."""
  selections = {}

  def hook(idx):
    def f(_, __, out):
      b, t, _k = out.shape
      mask = torch.zeros((b, t, t), dtype=torch.bool).scatter(-1, out.long(), True)
      selections[idx] = (mask & torch.ones(t, t, dtype=torch.bool).tril()).numpy()
    return f

  handles = [layer.self_attn.indexer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
  with torch.no_grad():
    logits = model(torch.as_tensor(np.asarray(tokens))).logits.numpy()
  for h in handles:
    h.remove()
  return logits, [selections[i] for i in range(len(selections))]


def our_forward(ckpt_dir, tokens, overrides):
  cfg = hf_import.converted_config(os.path.join(ckpt_dir, "maxtext"), overrides)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape([1] * len(cfg.mesh_axes)), cfg.mesh_axes)
  graphdef, params, buffers, _ = model_state.load_parameters(os.path.join(ckpt_dir, "maxtext"), cfg, mesh)
  model = model_state.merge(graphdef, params, buffers)
  (logits, _), inter = capture_selection(model, jnp.asarray(tokens))
  inter = inter.to_pure_dict() if hasattr(inter, "to_pure_dict") else inter
  masks = []
  for stack in ("dense_layers", "moe_layers"):
    for i in sorted(inter.get(stack, {}).get("layers", {})):
      masks.append(np.asarray(inter[stack]["layers"][i]["attention"]["indexer_mask"][0]))
  return np.asarray(logits), masks


def _convert(hf_dir, out_dir, overrides):
  hf_import.convert_checkpoint(hf_dir, os.path.join(out_dir, "maxtext"), overrides)


OVERRIDES = ["scan_layers=false", "matmul_precision=highest"]


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(3, 320, size=(2, SEQ))


def _compare(ours, theirs, our_masks, their_masks):
  rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  assert rel <= 1e-4, rel
  assert len(our_masks) == len(their_masks) == 3
  for i, (a, b) in enumerate(zip(our_masks, their_masks)):
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b, err_msg=f"layer {i} selection differs")
    # Sparsity matters: late queries select exactly TOPK of their > TOPK causal keys.
    assert (a[:, -1].sum(-1) == TOPK).all()


def test_bf16_free_fp32_checkpoint_matches_hf_logits_and_selections(tmp_path, tokens):
  model = build_hf_model()
  model.save_pretrained(tmp_path / "hf")
  _convert(str(tmp_path / "hf"), str(tmp_path), OVERRIDES)
  theirs, their_masks = hf_forward(model, tokens)
  ours, our_masks = our_forward(str(tmp_path), tokens, OVERRIDES)
  _compare(ours, theirs, our_masks, their_masks)


def _assert_every_mapped_key_arrives(cfg, hf: dict, may_be_default=()):
  """cfg holds each mapped config.json value, and none of them (but may_be_default) is base.yml's or
  the tiny model's."""
  derived = hf_import.config_from_hf(hf)
  assert set(derived) == set(MAPPED) | set(NOT_FROM_HF), "a mapped key this test does not check"
  defaults = [pyconfig.initialize(["test", "base.yml"], num_devices=1, ici_data_parallelism=1, model_name=name)
              for name in ("default", "deepseek3.2-tiny")]
  for key, hf_key in MAPPED.items():
    want = hf[hf_key] if isinstance(hf_key, str) else hf[hf_key[0]][hf_key[1]]
    assert getattr(cfg, key) == want, (key, getattr(cfg, key), want)
    assert key in may_be_default or all(getattr(d, key) != want for d in defaults), \
        f"{key}={want} is a default: the test cannot see it"
  for key, want in NOT_FROM_HF.items():
    assert getattr(cfg, key) == want, key


def test_every_mapped_config_json_key_reaches_our_config(tmp_path):
  hf = {**hf_config(**OFF_BASE).to_dict(), "num_nextn_predict_layers": 2}  # HF's model has no MTP layers
  hf_import.write_config(hf, str(tmp_path / "maxtext"))  # the model.yml convert_checkpoint writes
  _assert_every_mapped_key_arrives(hf_import.converted_config(str(tmp_path / "maxtext")), hf)


def test_config_off_base_yml_in_every_mapped_key_matches_hf(tmp_path, tokens):
  model = build_hf_model(seed=2, **OFF_BASE)
  model.save_pretrained(tmp_path / "hf")
  _convert(str(tmp_path / "hf"), str(tmp_path), OVERRIDES)
  hf = json.loads((tmp_path / "hf" / "config.json").read_text())
  cfg = hf_import.converted_config(str(tmp_path / "maxtext"), OVERRIDES)
  _assert_every_mapped_key_arrives(cfg, {**hf, "num_nextn_predict_layers": 0}, may_be_default=("mtp_num_layers",))
  theirs, their_masks = hf_forward(model, tokens % OFF_BASE["vocab_size"])
  ours, our_masks = our_forward(str(tmp_path), tokens % OFF_BASE["vocab_size"], OVERRIDES)
  _compare(ours, theirs, our_masks, their_masks)


@pytest.mark.parametrize("weight_quantization", ["none", "fp8_block"])
def test_fp8_block_quantized_checkpoint_matches_hf_on_dequantized_weights(tmp_path, tokens, weight_quantization):
  # none: the converter dequantizes; fp8_block: our model holds the fp8 bytes and dequantizes in the step.
  # Blocks of [32, 16] ([out, in]): several per matrix, partial ones at the edges (48, 40 rows).
  model = build_hf_model(seed=1)
  model.save_pretrained(tmp_path / "hf")
  make_fp8_checkpoint(str(tmp_path / "hf"), (32, 16), deq_dir=str(tmp_path / "deq"))
  model = transformers.DeepseekV32ForCausalLM.from_pretrained(str(tmp_path / "deq")).eval()
  model.config._attn_implementation = "eager"
  overrides = OVERRIDES + [f"weight_quantization={weight_quantization}"]
  _convert(str(tmp_path / "hf"), str(tmp_path), overrides)
  cfg = hf_import.converted_config(os.path.join(tmp_path, "maxtext"))  # model.yml alone rebuilds the layout
  assert cfg.weight_quantization == weight_quantization and cfg.weight_block_size == (32, 16)
  theirs, their_masks = hf_forward(model, tokens)
  ours, our_masks = our_forward(str(tmp_path), tokens, overrides)
  _compare(ours, theirs, our_masks, their_masks)


def test_converter_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_import.read_checkpoint(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({}))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    hf_import.read_checkpoint(str(tmp_path))
