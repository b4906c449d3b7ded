"""Our checkpoint -> HF DeepSeek-V3.2 safetensors + config.json (the inverse of convert_hf_checkpoint),
loadable by transformers' DeepseekV32ForCausalLM and servable by vLLM / SGLang.

    python -m MaxText.export_hf_checkpoint --checkpoint DIR --output DIR [--config YML] [key=value ...]

--checkpoint is a converter output (its model.yml is the default --config), a training run's
`outputs/<run>/checkpoints` (the newest step is exported), one step folder `checkpoints/<step>`, or
the run folder itself. Of a training checkpoint only params and buffers are read (not the optimizer
state); the MoE routing bias becomes `e_score_correction_bias`. Scanned layer stacks are written per
layer. --config and key=value describe the model as for training; the layer layout (scanned or not)
is read from the checkpoint itself. fp8 block-quantized weights (weight_quantization=fp8_block) are
written as they are, with their weight_scale_inv and config.json's quantization_config; --dtype applies
to the float weights. A LoRA run (lora_rank > 0, e.g. --config outputs/<run>/config.yml) is exported merged
(--lora merged, the default): the base from its load_parameters_path with the adapters of --checkpoint merged into
their kernels (over an fp8 base the merged weights are quantized again to e4m3: a small adapter mostly rounds
away); with --lora merged-float, the same merged into the base dequantized, the whole model written in --dtype
(no quantization_config: the adapters' effect kept, twice the fp8 bytes); or, with --lora peft, as peft's adapter_config.json + adapter_model.safetensors (transformers' module
names; the adapters float32, as trained) to load over the base's own HF export (docs/lora.md).
"""

from __future__ import annotations

import argparse
import sys

from MaxText.checkpoint import hf_format
from MaxText.checkpoint.hf_export import DTYPES, LORA_FORMATS, export
from MaxText.config import pyconfig


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m MaxText.export_hf_checkpoint", description=__doc__.split("\n\n")[0],
                               epilog=hf_format.KEY_VALUE_HELP + ". The inverse: python -m MaxText.convert_hf_checkpoint.")
  ap.add_argument("--checkpoint", required=True, help="converter output, outputs/<run>/checkpoints (newest step), "
                  "one step folder outputs/<run>/checkpoints/<step>, or outputs/<run>")
  ap.add_argument("--output", required=True, help="folder for config.json and *.safetensors (created if missing)")
  ap.add_argument("--config", default=None, help="the model's yml as for training (e.g. configs/base.yml); "
                  "default: --checkpoint's model.yml (a converter output)")
  ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                  help="weight dtype written (the routing bias stays float32, as in HF); default bfloat16")
  ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file before sharding with "
                  "model.safetensors.index.json (e.g. 5GB, 200MB, 100KiB); default 5GB")
  ap.add_argument("--lora", default="merged", choices=LORA_FORMATS, help="a LoRA run's checkpoint: merged into "
                  "the base (HF safetensors of the whole model; an fp8 base stays fp8, its merged weights rounded to "
                  "e4m3), merged-float (the same, every weight in --dtype: keeps a small adapter's effect over an fp8 "
                  "base), or peft's adapter files only; default merged")
  ap.add_argument("--base-model", default=None, help="with --lora peft: adapter_config.json's base_model_name_or_path "
                  "(the HF base the adapter is loaded over, e.g. its hub name or the folder of the base's export)")
  ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides over --config")
  args = ap.parse_args(argv)
  try:
    cfg, files, dropped = export(args.checkpoint, args.output, args.config, args.overrides, args.dtype,
                                 args.max_shard_size, args.lora, args.base_model)
  except (OSError, ValueError, pyconfig.ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if args.lora == "peft":
    print(f"exported {args.checkpoint} -> {args.output}: peft LoRA adapter ({', '.join(files)}), rank {cfg.lora_rank}, "
          f"lora_alpha {cfg.lora_alpha:g}, float32" + (f"; {len(dropped)} MTP module adapters left out (transformers "
                                                       "has no MTP module)" if dropped else ""))
    return
  print(f"exported {args.checkpoint} -> {args.output}: config.json + {len(files)} safetensors file(s), {args.dtype} "
        f"({cfg.num_decoder_layers} layers, {cfg.num_experts} experts, {cfg.mtp_num_layers} MTP)")


if __name__ == "__main__":
  main()
