"""Export: a converter output or a run's checkpoint -> HF DeepSeek-V3.2 safetensors + config.json.

The command line is MaxText/export_hf_checkpoint.py (which checkpoints it takes, the flags).
Invariants: only params and buffers are read (never the optimizer state); scanned layer stacks
are written per layer; the routing bias becomes `e_score_correction_bias` (float32); an import
of the export gives back the same parameters (tests/integration/test_export_hf.py).
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import ml_dtypes
import numpy as np

from MaxText.checkpoint import hf_format, read_scope
from MaxText.config import pyconfig
from MaxText.config.types import Config

CONFIG_FILE = "model.yml"  # what convert_hf_checkpoint writes next to its checkpoint
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_WHAT = ("give a converter output folder (holding model.yml), a run's checkpoints folder "
         "(outputs/<run>/checkpoints) or one step folder (outputs/<run>/checkpoints/<step>)")


# ---------------------------------------------------------------- finding and restoring the checkpoint
def find_checkpoint(path: str) -> str:
  """The orbax item folder holding params + buffers: `path` itself (converter output), <step>/state,
  or the newest <step>/state under a checkpoints folder or a run folder."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--checkpoint {path}: no such folder; {_WHAT}")
  if os.path.isdir(os.path.join(path, "state")):
    return os.path.join(path, "state")
  if os.path.isfile(os.path.join(path, "_METADATA")):
    return path
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  steps = [int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d, "state"))]
  if not steps:
    raise FileNotFoundError(f"--checkpoint {path}: not a checkpoint (no _METADATA, no <step>/state); {_WHAT}")
  return os.path.join(path, str(max(steps)), "state")


def _int_keys(tree):
  """orbax returns list indices (layer i, MTP module k) as strings: back to ints, as the model has them."""
  if not isinstance(tree, dict):
    return tree
  return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}


@read_scope.owned()  # a failed read's in-flight siblings end before the one-line error (issue 46)
def restore_raw(item: str) -> dict:
  """{"params", "buffers"} of an orbax item folder as host numpy arrays, in the layout saved (scanned or
  not); a training state's optimizer state and step are not read."""
  import orbax.checkpoint as ocp
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # orbax warns about a step's missing per-item metadata file
  item = os.path.abspath(item)
  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = ckptr.metadata(item)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
  except Exception as e:  # not an orbax pytree, or unreadable
    raise ValueError(f"--checkpoint {item}: cannot read orbax metadata ({type(e).__name__}); {_WHAT}") from None
  if not isinstance(tree, dict) or "params" not in tree:
    raise ValueError(f"--checkpoint {item}: holds {sorted(tree) if isinstance(tree, dict) else type(tree).__name__}, "
                     f"not params; {_WHAT}")
  wanted = {k: tree[k] for k in ("params", "buffers") if k in tree}  # not opt_state, step
  target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), wanted)
  args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  try:
    restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True))
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ValueError(f"--checkpoint {item}: restore failed ({type(e).__name__}: {first[:200]})") from None
  restored.setdefault("buffers", {})
  return _int_keys(restored)


def restore_parameters(path: str, cfg: Config) -> tuple[dict, dict]:
  """(params, buffers) of any checkpoint --checkpoint accepts, as numpy pure dicts in the layout and dtypes
  of model_state.abstract_model(cfg) (stacked when cfg.scan_layers), ready for model_state.merge."""
  from MaxText.checkpoint import model_state
  tree = unstacked_parameters(find_checkpoint(path), cfg)
  if cfg.scan_layers:
    tree = hf_format.stack_layers(tree)
  _, abs_p, abs_b = model_state.abstract_model(cfg)
  return (hf_format.check_against(tree["params"], abs_p.to_pure_dict(), f"--checkpoint {path} params"),
          hf_format.check_against(tree["buffers"], abs_b.to_pure_dict(), f"--checkpoint {path} buffers"))


def unstacked_parameters(item: str, cfg: Config) -> dict:
  """{"params", "buffers"} per layer (whatever layout was saved), checked against the model `cfg` describes
  and cast to its dtypes."""
  from MaxText.checkpoint import model_state
  tree = hf_format.unstack_layers(restore_raw(item))
  _, abs_p, abs_b = model_state.abstract_model(cfg.model_copy(update={"scan_layers": False}))
  return {part: hf_format.check_against(tree[part], abstract.to_pure_dict(), f"--checkpoint {item} ({part}; is "
                                        "--config / key=value the model it holds?)")
          for part, abstract in (("params", abs_p), ("buffers", abs_b))}


def merged_parameters(item: str, cfg: Config) -> dict:
  """{"params", "buffers"} per layer of a LoRA run: the base from cfg.load_parameters_path (the run's config.yml
  names it) with the adapters of `item` merged into their kernels (lora.merged: W + alpha/r A B; an fp8 base is
  quantized again per block after the merge)."""
  from MaxText.layers import lora
  from MaxText.layers.linears import kernel_block
  if not cfg.load_parameters_path:
    raise ValueError(f"--checkpoint {item} holds LoRA adapters (lora_rank={cfg.lora_rank}): the base comes from "
                     "load_parameters_path; give load_parameters_path=BASE (the run's config.yml has it)")
  base = unstacked_parameters(find_checkpoint(cfg.load_parameters_path), cfg.model_copy(update={"lora_rank": 0}))
  adapters = hf_format.unstack_layers(restore_raw(item))["params"]
  if not adapters or not all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)):
    raise ValueError(f"--checkpoint {item}: not a LoRA run's checkpoint (its params are not only lora_a/lora_b); "
                     "export it without lora_rank")
  scale = cfg.lora_alpha / cfg.lora_rank
  return {"params": lora.merged(base["params"], adapters, scale, kernel_block(cfg)), "buffers": base["buffers"]}


# ---------------------------------------------------------------- the config
def export_config(checkpoint: str, config_path: str | None, overrides=()) -> Config:
  """The model's Config: --config (default: the converter's model.yml in --checkpoint) + key=value, on one
  device (the export needs no mesh)."""
  if config_path is None:
    config_path = os.path.join(checkpoint, CONFIG_FILE)
    if not os.path.isfile(config_path):
      raise FileNotFoundError(f"--checkpoint {checkpoint} has no {CONFIG_FILE}: give --config, the yml the run "
                              "was trained with (e.g. configs/base.yml), and the key=value it was trained with")
  ones = {f"ici_{a}_parallelism": 1 for a in ("data", "fsdp", "context", "tensor", "expert")}
  return pyconfig.initialize(["export", config_path, *overrides], num_devices=1, **ones)


# ---------------------------------------------------------------- writing
def parse_size(text: str) -> int:
  """'5GB', '200MB', '64KiB', '1000' -> bytes (decimal units as HF's max_shard_size; KiB/MiB/GiB binary)."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
  if not m:
    raise ValueError(f"--max-shard-size {text!r}: give a size such as 5GB, 200MB or a number of bytes")
  unit = m.group(2).upper().rstrip("B")
  base = 1024 if unit.endswith("I") else 1000
  return int(float(m.group(1)) * base ** " KMGT".index(unit.rstrip("I") or " "))


def prepare_output(output: str) -> None:
  """Creates OUTPUT or says why it cannot."""
  if os.path.exists(output) and not os.path.isdir(output):
    raise FileExistsError(f"--output {output}: is a file; give a folder (it is created if missing)")
  try:
    os.makedirs(output, exist_ok=True)
  except OSError as e:
    raise PermissionError(f"--output {output}: cannot create it ({e.strerror}); give a writable folder") from None
  if not os.access(output, os.W_OK | os.X_OK):
    raise PermissionError(f"--output {output}: not writable; give a writable folder")


def remove_earlier_export(output: str) -> None:
  """A stale shard of an earlier export would be loaded with the new ones."""
  for f in glob.glob(os.path.join(output, "model*.safetensors")) + [os.path.join(output, hf_format.INDEX_FILE)]:
    if os.path.isfile(f):
      os.remove(f)


def export(checkpoint: str, output: str, config_path: str | None = None, overrides=(), dtype: str = "bfloat16",
           max_shard_size: str = "5GB") -> tuple[Config, list[str]]:
  """Writes OUTPUT/config.json and the safetensors shards; returns the Config and the file names."""
  if dtype not in DTYPES:
    raise ValueError(f"--dtype {dtype}: give one of {sorted(DTYPES)}")
  max_bytes = parse_size(max_shard_size)
  item = find_checkpoint(checkpoint)
  cfg = export_config(checkpoint, config_path, overrides)
  hf_config = hf_format.config_to_hf(cfg, dtype)  # refuses a model HF cannot hold, before the restore
  prepare_output(output)
  tree = merged_parameters(item, cfg) if cfg.lora_rank else unstacked_parameters(item, cfg)
  remove_earlier_export(output)
  files = hf_format.write_sharded(output, hf_format.to_hf(tree, cfg, DTYPES[dtype]), max_bytes)
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  return cfg, files
