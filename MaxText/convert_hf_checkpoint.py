"""HF DeepSeek-V3.2 checkpoint (config.json + safetensors; bf16/fp32 or fp8 e4m3 with 128x128
block `weight_scale_inv`) -> our orbax parameter checkpoint.

    python -m MaxText.convert_hf_checkpoint --hf-path DIR --output DIR [key=value ...]

The model config is derived from config.json (`config_from_hf`); extra key=value arguments
override it (e.g. scan_layers=false). train.py (load_parameters_path=) and decode.py load
the result. Safetensors are read with numpy + ml_dtypes directly (no torch needed).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
  _HERE = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [os.path.dirname(_HERE)]

import argparse
import glob
import json
import struct

import jax
import ml_dtypes
import numpy as np

from MaxText import model_state, pyconfig
from MaxText.types import Config

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "I64": np.int64, "I32": np.int32, "U8": np.uint8}
BLOCK = 128


# ---------------------------------------------------------------- reading
def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file as numpy arrays (memory-mapped)."""
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
    a, b = meta["data_offsets"]
    out[name] = np.frombuffer(data[a:b], dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
  return out


def read_checkpoint(hf_path: str) -> tuple[dict, dict[str, np.ndarray]]:
  cfg_path = os.path.join(hf_path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"--hf-path {hf_path}: no config.json")
  files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"--hf-path {hf_path}: no *.safetensors files")
  tensors = {}
  for f in files:
    tensors.update(read_safetensors(f))
  with open(cfg_path) as f:
    return json.load(f), tensors


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
  """w [out,in] e4m3, scale_inv [ceil(out/128), ceil(in/128)] -> float32 w * scale per 128x128 block."""
  out_dim, in_dim = w.shape
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), BLOCK, axis=0), BLOCK, axis=1)[:out_dim, :in_dim]
  return w.astype(np.float32) * s


def dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Every weight as float32; fp8 weights are multiplied by their block scales, which are dropped."""
  out = {}
  for name, t in tensors.items():
    if name.endswith("weight_scale_inv"):
      continue
    if t.dtype == ml_dtypes.float8_e4m3fn:
      scale = tensors.get(name + "_scale_inv")
      if scale is None:
        raise ValueError(f"fp8 tensor {name} has no {name}_scale_inv")
      out[name] = dequantize_fp8(t, scale)
    else:
      out[name] = np.asarray(t, dtype=np.float32)
  return out


# ---------------------------------------------------------------- config
def config_from_hf(hf: dict) -> dict:
  """Our config keys from an HF DeepSeek-V3.2 config.json."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  n_layers = hf["num_hidden_layers"]
  overrides = dict(
      vocab_size=hf["vocab_size"], emb_dim=hf["hidden_size"], mlp_dim=hf["intermediate_size"],
      num_decoder_layers=n_layers, first_num_dense_layers=min(hf.get("first_k_dense_replace", 3), n_layers),
      normalization_layer_epsilon=hf.get("rms_norm_eps", 1e-6),
      num_query_heads=hf["num_attention_heads"], q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
      qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
      max_position_embeddings=hf.get("max_position_embeddings", 163840),
      rope_max_timescale=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      use_indexer=True, indexer_n_heads=hf["index_n_heads"], indexer_head_dim=hf["index_head_dim"],
      indexer_topk=hf["index_topk"],
      num_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
      n_routing_groups=hf.get("n_group", 1), topk_routing_group=hf.get("topk_group", 1),
      shared_experts=hf.get("n_shared_experts", 1), moe_mlp_dim=hf["moe_intermediate_size"],
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
      norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
      mtp_num_layers=int(hf.get("num_nextn_predict_layers", 0)),
  )
  if rope.get("rope_type", rope.get("type", "default")) == "yarn":
    m, m_all = rope.get("mscale", 1.0), rope.get("mscale_all_dim", 0)
    if m_all and m != m_all:
      raise ValueError(f"rope mscale={m} != mscale_all_dim={m_all}: cos/sin would carry an extra scale "
                       "we do not model (DeepSeek-V3.2 sets both to 1.0)")
    overrides.update(rope_type="yarn", rope_factor=float(rope["factor"]),
                     original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                     beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                     mscale=float(m_all or 1.0))
  else:
    overrides.update(rope_type="default", rope_factor=1.0)
  return overrides


# ---------------------------------------------------------------- mapping
def _t(w):  # HF Linear [out,in] -> our kernel [in,out]
  return np.ascontiguousarray(w.T)


def _attention(w, p: str) -> dict:
  a = {
      "wq_a": {"kernel": _t(w[p + "self_attn.q_a_proj.weight"])},
      "q_norm": {"scale": w[p + "self_attn.q_a_layernorm.weight"]},
      "wq_b": {"kernel": _t(w[p + "self_attn.q_b_proj.weight"])},
      "wkv_a": {"kernel": _t(w[p + "self_attn.kv_a_proj_with_mqa.weight"])},
      "kv_norm": {"scale": w[p + "self_attn.kv_a_layernorm.weight"]},
      "wkv_b": {"kernel": _t(w[p + "self_attn.kv_b_proj.weight"])},
      "wo": {"kernel": _t(w[p + "self_attn.o_proj.weight"])},
  }
  i = p + "self_attn.indexer."
  a["indexer"] = {
      "wq_b": {"kernel": _t(w[i + "wq_b.weight"])},
      "wk": {"kernel": _t(w[i + "wk.weight"])},
      "k_norm": {"scale": w[i + "k_norm.weight"], "bias": w[i + "k_norm.bias"]},
      "weights_proj": {"kernel": _t(w[i + "weights_proj.weight"])},
  }
  return a


def _mlp(w, p: str) -> dict:
  return {"gate": {"kernel": _t(w[p + "gate_proj.weight"])}, "up": {"kernel": _t(w[p + "up_proj.weight"])},
          "down": {"kernel": _t(w[p + "down_proj.weight"])}}


def _experts(w, p: str, num_experts: int, inter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(wi_0 [E,D,I], wi_1 [E,D,I], wo [E,I,D]) from per-expert or fused HF tensors."""
  if p + "experts.gate_up_proj" in w:  # transformers' fused layout: [E,2I,D] and [E,D,I]
    gu = w[p + "experts.gate_up_proj"]
    return (np.ascontiguousarray(np.swapaxes(gu[:, :inter], 1, 2)),
            np.ascontiguousarray(np.swapaxes(gu[:, inter:], 1, 2)),
            np.ascontiguousarray(np.swapaxes(w[p + "experts.down_proj"], 1, 2)))
  g = np.stack([_t(w[f"{p}experts.{e}.gate_proj.weight"]) for e in range(num_experts)])  # [E,D,I]
  u = np.stack([_t(w[f"{p}experts.{e}.up_proj.weight"]) for e in range(num_experts)])  # [E,D,I]
  d = np.stack([_t(w[f"{p}experts.{e}.down_proj.weight"]) for e in range(num_experts)])  # [E,I,D]
  return g, u, d


def _layer(w, cfg: Config, idx: int, moe: bool) -> tuple[dict, dict]:
  """(params, buffers) of decoder layer `idx` in our naming."""
  p = f"model.layers.{idx}."
  params = {"pre_attention_norm": {"scale": w[p + "input_layernorm.weight"]},
            "attention": _attention(w, p),
            "pre_mlp_norm": {"scale": w[p + "post_attention_layernorm.weight"]}}
  buffers = {}
  if moe:
    m = p + "mlp."
    wi_0, wi_1, wo = _experts(w, m, cfg.num_experts, cfg.moe_mlp_dim)
    params["mlp"] = {"gate_kernel": _t(w[m + "gate.weight"]), "wi_0": wi_0, "wi_1": wi_1, "wo": wo}
    if cfg.shared_experts:
      params["mlp"]["shared_experts"] = _mlp(w, m + "shared_experts.")
    if cfg.routed_bias:
      bias = w.get(m + "gate.e_score_correction_bias", np.zeros((cfg.num_experts,), np.float32))
      buffers = {"mlp": {"routing_bias": bias}}
  else:
    params["mlp"] = _mlp(w, p + "mlp.")
  return params, buffers


def _stack(trees: list[dict]) -> dict:
  return jax.tree.map(lambda *a: np.stack(a), *trees)


def convert(hf_weights: dict[str, np.ndarray], cfg: Config) -> tuple[dict, dict]:
  """HF tensor names -> our (params, buffers) pure dicts, shaped like model_state.abstract_model(cfg)."""
  w = hf_weights
  params = {"embed": {"embedding": w["model.embed_tokens.weight"]},
            "final_norm": {"scale": w["model.norm.weight"]},
            "output_head": {"kernel": _t(w["lm_head.weight"])}}
  buffers = {}
  stacks = (("dense_layers", range(cfg.first_num_dense_layers), False),
            ("moe_layers", range(cfg.first_num_dense_layers, cfg.num_decoder_layers), True))
  for name, idxs, moe in stacks:
    if not len(idxs):
      continue
    layers = [_layer(w, cfg, i, moe) for i in idxs]
    ps, bs = [l[0] for l in layers], [l[1] for l in layers]
    if cfg.scan_layers:
      params[name] = {"layers": _stack(ps)}
      if moe:
        buffers[name] = {"layers": _stack(bs)}
    else:
      params[name] = {"layers": dict(enumerate(ps))}
      if moe:
        buffers[name] = {"layers": dict(enumerate(bs))}
  if cfg.mtp_num_layers:
    params["mtp"], buffers["mtp"] = {}, {}
    for k in range(cfg.mtp_num_layers):
      idx = cfg.num_decoder_layers + k
      p = f"model.layers.{idx}."
      if p + "eh_proj.weight" not in w:
        raise ValueError(f"mtp_num_layers={cfg.mtp_num_layers} but the checkpoint has no {p}eh_proj.weight")
      lp, lb = _layer(w, cfg, idx, cfg.num_experts > 0)
      params["mtp"][k] = {"embed_norm": {"scale": w[p + "enorm.weight"]},
                          "hidden_norm": {"scale": w[p + "hnorm.weight"]},
                          "projection": {"kernel": _t(w[p + "eh_proj.weight"])},
                          "layer": lp, "final_norm": {"scale": w[p + "shared_head.norm.weight"]}}
      buffers["mtp"][k] = {"layer": lb}
  return params, _prune(buffers)


def _prune(tree):
  """Drops empty sub-dicts (a model without routing biases has no buffers there)."""
  if not isinstance(tree, dict):
    return tree
  out = {k: _prune(v) for k, v in tree.items()}
  return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}


def _check_and_cast(tree: dict, abstract: dict, what: str) -> dict:
  """Same structure and shapes as the model built from the config; cast to its dtypes."""
  flat_t = dict(jax.tree_util.tree_leaves_with_path(tree))
  flat_a = dict(jax.tree_util.tree_leaves_with_path(abstract))
  missing = sorted(jax.tree_util.keystr(k) for k in flat_a.keys() - flat_t.keys())
  extra = sorted(jax.tree_util.keystr(k) for k in flat_t.keys() - flat_a.keys())
  if missing or extra:
    raise ValueError(f"{what}: converted tree does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
  for k, a in flat_a.items():
    if tuple(flat_t[k].shape) != tuple(a.shape):
      raise ValueError(f"{what}{jax.tree_util.keystr(k)}: checkpoint shape {flat_t[k].shape} != model {a.shape}")
  return jax.tree.map(lambda t, a: np.asarray(t, dtype=a.dtype), tree, abstract)


CONFIG_FILE = "model.yml"


def converted_config(output: str, overrides=()) -> Config:
  """The Config of a converted checkpoint: its model.yml (layered over base.yml) + key=value overrides.
  The same file works on the command line: `python MaxText/decode.py OUTPUT/model.yml load_parameters_path=OUTPUT`."""
  return pyconfig.initialize(["convert", os.path.join(output, CONFIG_FILE), *overrides],
                             num_devices=1, ici_data_parallelism=1)


def write_config(hf_cfg: dict, output: str, header: str = "") -> None:
  """OUTPUT/model.yml: config_from_hf(hf_cfg) over base.yml alone (model_name default)."""
  import yaml
  os.makedirs(output, exist_ok=True)
  with open(os.path.join(output, CONFIG_FILE), "w") as f:
    f.write(header)
    yaml.safe_dump({"model_name": "default", **config_from_hf(hf_cfg)}, f, sort_keys=False)


def convert_checkpoint(hf_path: str, output: str, overrides=()) -> Config:
  """Converts and writes OUTPUT (orbax params + buffers) and OUTPUT/model.yml; returns the Config used."""
  hf_cfg, tensors = read_checkpoint(hf_path)
  write_config(hf_cfg, output)
  cfg = converted_config(output, overrides)
  params, buffers = convert(dequantized(tensors), cfg)
  _, abs_p, abs_b = model_state.abstract_model(cfg)
  params = _check_and_cast(params, abs_p.to_pure_dict(), "params")
  buffers = _check_and_cast(buffers, abs_b.to_pure_dict(), "buffers")
  model_state.save_parameters(os.path.abspath(output), params, buffers)  # replaces the folder
  write_config(hf_cfg, output,
               f"# Derived from {os.path.abspath(hf_path)}/config.json by MaxText.convert_hf_checkpoint\n")
  return cfg


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf-path", required=True, help="folder with config.json and *.safetensors")
  ap.add_argument("--output", required=True, help="folder for the orbax parameter checkpoint")
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = ap.parse_args(argv)
  try:
    cfg = convert_checkpoint(args.hf_path, args.output, args.overrides)
  except (FileNotFoundError, ValueError, pyconfig.ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"converted {args.hf_path} -> {args.output} ({cfg.num_decoder_layers} layers, "
        f"{cfg.num_experts} experts); its config: {os.path.join(args.output, CONFIG_FILE)}")


if __name__ == "__main__":
  main()
