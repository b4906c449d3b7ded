"""Import: HF DeepSeek-V3.2 safetensors (bf16/fp32, or fp8 e4m3 with 128x128 block
`weight_scale_inv`, dequantized here) -> our orbax parameter checkpoint and its model.yml.

The command line is MaxText/convert_hf_checkpoint.py. Invariants: the converted tree has exactly
the abstract model's names and shapes (hf_format.check_against); the config is derived from
config.json (hf_format.config_from_hf), so the model.yml beside the weights rebuilds the model.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from MaxText.checkpoint import hf_format, model_state
from MaxText.checkpoint.hf_format import config_from_hf, read_safetensors  # noqa: F401  (the importer's public names)
from MaxText.config import pyconfig
from MaxText.config.types import Config

BLOCK = 128


def read_checkpoint(hf_path: str) -> tuple[dict, dict[str, np.ndarray]]:
  cfg_path = os.path.join(hf_path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"--hf-path {hf_path}: no config.json")
  tensors = hf_format.read_folder(hf_path, "--hf-path ")
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


def convert(hf_weights: dict[str, np.ndarray], cfg: Config) -> tuple[dict, dict]:
  """HF tensor names -> our (params, buffers) pure dicts, shaped like model_state.abstract_model(cfg)."""
  tree = hf_format.from_hf(hf_weights, cfg)
  if cfg.scan_layers:
    tree = hf_format.stack_layers(tree)
  return tree["params"], tree["buffers"]


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
  params = hf_format.check_against(params, abs_p.to_pure_dict(), "converted params")
  buffers = hf_format.check_against(buffers, abs_b.to_pure_dict(), "converted buffers")
  model_state.save_parameters(os.path.abspath(output), params, buffers)  # replaces the folder
  write_config(hf_cfg, output,
               f"# Derived from {os.path.abspath(hf_path)}/config.json by MaxText.convert_hf_checkpoint\n")
  return cfg
