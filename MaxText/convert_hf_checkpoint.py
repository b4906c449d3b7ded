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
import json

import ml_dtypes
import numpy as np

from MaxText import hf_format, model_state, pyconfig
from MaxText.hf_format import config_from_hf, read_safetensors  # noqa: F401  (the importer's public names)
from MaxText.types import Config

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


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m MaxText.convert_hf_checkpoint", description=__doc__.split("\n\n")[0],
                               epilog=hf_format.KEY_VALUE_HELP + ". The inverse: python -m MaxText.export_hf_checkpoint.")
  ap.add_argument("--hf-path", required=True, help="folder with config.json and *.safetensors")
  ap.add_argument("--output", required=True, help="folder for the orbax parameter checkpoint and its model.yml")
  ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides over the derived model.yml")
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
