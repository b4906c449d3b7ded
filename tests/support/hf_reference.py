"""Hugging Face's DeepseekV32ForCausalLM as the oracle: a tiny model with non-trivial norms and biases, and
DeepSeek's fp8 checkpoint format written from it (test_hf_parity.py, test_export_hf.py). Import after
pytest.importorskip("torch") and ("transformers")."""

import json
import os

import torch
import transformers

TOPK = 8  # the tiny model's index_topk (smaller than the parity tests' sequences)


def hf_config(**changes):
  kw = dict(
      vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
      first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
      n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
      kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
      index_topk=TOPK, index_head_dim=32, index_n_heads=16,  # 16 heads: an all-zero relu tie is ~2**-16
      max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                       "mscale": 1.0, "mscale_all_dim": 1.0},
  )
  return transformers.DeepseekV32Config(**{**kw, **changes})


def build_hf_model(seed=0, **changes):
  torch.manual_seed(seed)
  model = transformers.DeepseekV32ForCausalLM(hf_config(**changes)).eval()
  model.config._attn_implementation = "eager"
  with torch.no_grad():  # make norms and biases non-trivial so the test sees their mapping
    for name, p in model.named_parameters():
      if name.endswith("layernorm.weight") or name.endswith("norm.weight") or "k_norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      if name.endswith("k_norm.bias"):
        p.copy_(0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn_like(b))
  return model


def _quantize_e4m3(w: torch.Tensor, block=(128, 128)):
  """Block-quantize w [out,in] to e4m3 with per-block scale_inv (as DeepSeek's fp8 checkpoints; block [out,in])."""
  out_d, in_d = w.shape
  bo, bi = block
  nb_o, nb_i = -(-out_d // bo), -(-in_d // bi)
  scale = torch.zeros(nb_o, nb_i)
  q = torch.zeros_like(w)
  for i in range(nb_o):
    for j in range(nb_i):
      blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
      s = blk.abs().max().clamp(min=1e-12) / 448.0
      scale[i, j] = s
      q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = blk / s
  q8 = q.to(torch.float8_e4m3fn)
  deq = q8.float() * torch.repeat_interleave(torch.repeat_interleave(scale, bo, 0), bi, 1)[:out_d, :in_d]
  return q8, scale, deq


# What DeepSeek's fp8 checkpoints leave in bf16: embeddings, head, norms, the router, the indexer's
# weights_proj and the MTP projection (and its copies of embedding and head).
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm.", "layernorm", "mlp.gate.weight", "weights_proj", "eh_proj",
                 "shared_head.head")


def make_fp8_checkpoint(hf_dir, block=(128, 128), deq_dir=None):
  """Rewrites the HF checkpoint in hf_dir as DeepSeek's fp8 checkpoints are: every block-quantized linear
  e4m3 + `weight_scale_inv` per block, the rest bf16 (the router bias fp32), quantization_config in
  config.json. deq_dir (the oracle): the same folder with each fp8 weight dequantized in fp32."""
  from safetensors.torch import load_file, save_file
  shard = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
  assert len(shard) == 1
  path = os.path.join(hf_dir, shard[0])
  sd = load_file(path)
  quantized, deq_sd = {}, {}
  for name, w in sd.items():
    if w.ndim == 2 and name.endswith(".weight") and not any(n in name for n in NOT_QUANTIZED):
      q8, scale, deq = _quantize_e4m3(w.float(), block)
      quantized[name], quantized[name + "_scale_inv"] = q8, scale
      deq_sd[name] = deq
    else:
      quantized[name] = w if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
      deq_sd[name] = quantized[name].float()
  assert any("indexer.wk" in n for n in deq_sd) and any("experts.0." in n for n in quantized)
  if deq_dir is not None:  # the oracle: HF run on the dequantized weights (same names, no quantization_config)
    os.makedirs(deq_dir)
    save_file(deq_sd, os.path.join(deq_dir, shard[0]), metadata={"format": "pt"})
    for f in os.listdir(hf_dir):
      if f.endswith(".json"):
        with open(os.path.join(hf_dir, f), "rb") as src, open(os.path.join(deq_dir, f), "wb") as dst:
          dst.write(src.read())
  save_file(quantized, path, metadata={"format": "pt"})
  cfg_path = os.path.join(hf_dir, "config.json")
  cfg = json.load(open(cfg_path))
  cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": list(block)}
  json.dump(cfg, open(cfg_path, "w"), indent=2)
