"""HF DeepSeek-V3.2 checkpoint (config.json + safetensors; bf16/fp32 or fp8 e4m3 with 128x128
block `weight_scale_inv`) -> our orbax parameter checkpoint.

    python -m MaxText.convert_hf_checkpoint --hf-path DIR --output DIR [key=value ...]

The model config is derived from config.json (`config_from_hf`); extra key=value arguments
override it (e.g. scan_layers=false). train.py (load_parameters_path=) and decode.py load
the result. weight_quantization=fp8_block keeps an fp8 checkpoint's e4m3 weights and block scales as
they are (for serving; train.py refuses fp8); without it they are dequantized. Safetensors are read with numpy + ml_dtypes directly (no torch needed).
"""

from __future__ import annotations

import argparse
import os
import sys

from MaxText.checkpoint import hf_format
from MaxText.checkpoint.hf_import import CONFIG_FILE, convert_checkpoint
from MaxText.config import pyconfig


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
