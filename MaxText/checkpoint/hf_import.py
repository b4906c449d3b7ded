"""Import: HF DeepSeek-V3.2 safetensors (bf16/fp32, or fp8 e4m3 with 128x128 block
`weight_scale_inv`) -> our orbax parameter checkpoint and its model.yml.

The command line is MaxText/convert_hf_checkpoint.py. Invariants: the converted tree has exactly
the abstract model's names, shapes and dtypes (hf_format.check_against); the config is derived from
config.json (hf_format.config_from_hf), so the model.yml beside the weights rebuilds the model.
fp8 weights: with weight_quantization=fp8_block they are kept as they are, bytes and scales (a float
weight the model holds in fp8 is quantized per block); with none they are dequantized (fp32, then
weight_dtype) and the scales dropped (linears.requantized).
"""

from __future__ import annotations

import json
import os

import numpy as np

from MaxText.checkpoint import hf_format, model_state
from MaxText.checkpoint.hf_format import config_from_hf, read_safetensors  # noqa: F401  (the importer's public names)
from MaxText.config import pyconfig
from MaxText.config.types import Config
from MaxText.layers.linears import kernel_block, requantized


def read_checkpoint(hf_path: str) -> tuple[dict, dict[str, np.ndarray]]:
  cfg_path = os.path.join(hf_path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"--hf-path {hf_path}: no config.json")
  tensors = hf_format.read_folder(hf_path, "--hf-path ")
  with open(cfg_path) as f:
    return json.load(f), tensors


def convert(hf_weights: dict[str, np.ndarray], cfg: Config) -> tuple[dict, dict]:
  """HF tensor names -> our (params, buffers) pure dicts, laid out as model_state.abstract_model(cfg):
  fp8 where it holds fp8 (weight_quantization=fp8_block), float elsewhere."""
  tree = hf_format.from_hf(hf_weights, cfg)
  if cfg.scan_layers:
    tree = hf_format.stack_layers(tree)
  _, abs_p, _ = model_state.abstract_model(cfg)
  return requantized(tree["params"], abs_p.to_pure_dict(), kernel_block(cfg)), tree["buffers"]


CONFIG_FILE = "model.yml"


def converted_config(output: str, overrides=()) -> Config:
  """The Config of a converted checkpoint: its model.yml (layered over base.yml) + key=value overrides.
  The same file works on the command line: `python MaxText/decode.py OUTPUT/model.yml load_parameters_path=OUTPUT`."""
  return pyconfig.initialize(["convert", os.path.join(output, CONFIG_FILE), *overrides],
                             num_devices=1, ici_data_parallelism=1)


def write_config(hf_cfg: dict, output: str, header: str = "", weight_quantization: str = "none") -> None:
  """OUTPUT/model.yml: config_from_hf(hf_cfg) over base.yml alone (model_name default), the block of an fp8
  checkpoint's scales (weight_block_size), and weight_quantization when it is not none."""
  import yaml
  os.makedirs(output, exist_ok=True)
  keys = {"model_name": "default", **config_from_hf(hf_cfg), **hf_format.quantization_from_hf(hf_cfg)}
  if weight_quantization != "none":
    keys["weight_quantization"] = weight_quantization
  with open(os.path.join(output, CONFIG_FILE), "w") as f:
    f.write(header)
    yaml.safe_dump(keys, f, sort_keys=False)


def convert_checkpoint(hf_path: str, output: str, overrides=()) -> Config:
  """Converts and writes OUTPUT (orbax params + buffers) and OUTPUT/model.yml; returns the Config used."""
  hf_cfg, tensors = read_checkpoint(hf_path)
  write_config(hf_cfg, output)
  cfg = converted_config(output, overrides)
  params, buffers = convert(tensors, cfg)
  _, abs_p, abs_b = model_state.abstract_model(cfg)
  params = hf_format.check_against(params, abs_p.to_pure_dict(), "converted params")
  buffers = hf_format.check_against(buffers, abs_b.to_pure_dict(), "converted buffers")
  model_state.save_parameters(os.path.abspath(output), params, buffers)  # replaces the folder
  write_config(hf_cfg, output,
               f"# Derived from {os.path.abspath(hf_path)}/config.json by MaxText.convert_hf_checkpoint\n",
               cfg.weight_quantization)
  return cfg
