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
from MaxText.layers.moe import ADAPTER_SUFFIX

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
  of model_state.abstract_model(cfg) (stacked when cfg.scan_layers), ready for model_state.merge. A LoRA run's
  (cfg.lora_rank > 0) comes merged into its base (`merged_parameters`), laid out as the model without adapters."""
  from MaxText.checkpoint import model_state
  if cfg.lora_rank:
    tree = merged_parameters(find_checkpoint(path), cfg)
    cfg = cfg.model_copy(update={"lora_rank": 0})
  else:
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


def lora_adapters(item: str) -> dict:
  """The adapters of a LoRA run's checkpoint `item` (every lora_a / lora_b leaf, per layer), nested as params."""
  from MaxText.layers import lora
  adapters = hf_format.unstack_layers(restore_raw(item))["params"]
  if not adapters or not all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)):
    raise ValueError(f"--checkpoint {item}: not a LoRA run's checkpoint (its params are not only lora_a/lora_b); "
                     "export it without lora_rank")
  return adapters


def merged_parameters(item: str, cfg: Config, requantize: bool = True) -> dict:
  """{"params", "buffers"} per layer of a LoRA run: the base from cfg.load_parameters_path (the run's config.yml
  names it) with the adapters of `item` merged into their kernels (lora.merged: W + alpha/r A B in fp32). An fp8
  base: quantized again per block after the merge (requantize, --lora merged: the merged weight rounds to e4m3, so a
  small adapter mostly rounds away), or every weight dequantized to fp32 first and the merged model float
  (requantize=False, --lora merged-float). A base other than the one `item` records is a ConfigError."""
  from MaxText.layers import lora
  from MaxText.layers.linears import dequantized, kernel_block
  if not cfg.load_parameters_path:
    raise ValueError(f"--checkpoint {item} holds LoRA adapters (lora_rank={cfg.lora_rank}): the base comes from "
                     "load_parameters_path; give load_parameters_path=BASE (the run's config.yml has it)")
  from MaxText.checkpoint import orbax_state
  adapters = lora_adapters(item)
  base = unstacked_parameters(find_checkpoint(cfg.load_parameters_path), cfg.model_copy(update={"lora_rank": 0}))
  held = hf_format.stack_layers(base) if cfg.scan_layers else base  # as the run's train state held it
  orbax_state.check_base(orbax_state.step_base_record(os.path.dirname(item)),
                         int(orbax_state.base_fingerprint(lora.join(held["params"], held["buffers"]))),
                         cfg.load_parameters_path, f"--checkpoint {item}", cfg.lora_check_base)
  scale = cfg.lora_alpha / cfg.lora_rank
  params = base["params"] if requantize else dequantized(base["params"])
  return {"params": lora.merged(params, adapters, scale, kernel_block(cfg)), "buffers": base["buffers"]}


# ---------------------------------------------------------------- peft's format
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's name of the wrapped transformers model in its saved state dict


def peft_tensors(adapters: dict, cfg: Config) -> tuple[dict[str, np.ndarray], list[str], list[str], dict[str, int]]:
  """Our adapters (per layer, nested as params) -> (peft's tensors, the adapted modules' or expert parameters'
  transformers names, the ones left out, {expert parameter: its peft rank}). Each adapted HF Linear
  `<module>.weight` [out, in] gets `base_model.model.<module>.lora_A.weight` = A^T [r, in] and `.lora_B.weight` =
  B^T [out, r], float32, so that peft's W x + (lora_alpha / r) B^T A^T x is ours. Routed-expert adapters become
  peft's ParamWrapper over the fused expert parameters (`peft_expert_tensors`). The MTP layer's adapters are left
  out (transformers' DeepseekV32ForCausalLM has no MTP module for them)."""
  flat = hf_format.flatten({"params": adapters})
  tensors, modules, dropped, used, experts = {}, [], [], set(), {}
  for t in hf_format.tensor_map(cfg):
    if t.role == "copy" or t.expert not in (None, 0):
      continue
    weight = (*t.ours[:-1], t.ours[-1] + ADAPTER_SUFFIX) if t.expert == 0 else t.ours[:-1]  # ours: wi_0 | kernel
    a_path, b_path = (*weight, "lora_a"), (*weight, "lora_b")
    if a_path not in flat:
      continue
    used |= {a_path, b_path}
    module = t.hf[:-len(".weight")] if t.expert is None else t.hf.rsplit(".", 3)[0]  # `<layer>.mlp.experts`
    if t.ours[1] == "mtp":
      dropped.append(module if t.expert is None else f"{module}.{t.hf.rsplit('.', 2)[-2]}")
      continue
    if t.expert == 0:  # [E, in, r], [E, r, out] per HF weight name (gate_proj | up_proj | down_proj)
      experts.setdefault(module, {})[t.hf.rsplit(".", 2)[-2]] = (flat[a_path], flat[b_path])
      continue
    modules.append(module)
    tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(flat[a_path], np.float32).T)
    tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(flat[b_path], np.float32).T)
  rest = sorted({"/".join(map(str, k[1:-1])) for k in flat.keys() - used})
  if rest:
    raise ValueError(f"--lora peft: the adapters of {rest[0]} (and {len(rest) - 1} more) have no module in peft's "
                     "view of transformers' DeepseekV32ForCausalLM; export with --lora merged")
  ranks = {}
  for module, got in experts.items():
    more, names = peft_expert_tensors(module, got)
    tensors.update(more)
    ranks.update(names)
  return tensors, modules + sorted(ranks), dropped, ranks


def _expert_lora(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-expert A [E, in, r], B [E, r, out] -> peft ParamWrapper's lora_A.weight [E*r, in] (row e*r + k: A_e's
  column k) and lora_B.weight [out, r*E] (column k*E + e: B_e's row k), as its get_delta_weight reshapes them
  (A -> (E, r, in), B -> (out, r, E)): expert e's delta is (A_e B_e)^T [out, in], transformers' layout."""
  e, n_in, r = a.shape
  lora_a = np.asarray(a, np.float32).transpose(0, 2, 1).reshape(e * r, n_in)  # [E*r, in]
  lora_b = np.asarray(b, np.float32).transpose(2, 1, 0).reshape(b.shape[-1], r * e)  # [out, r*E]
  return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def peft_expert_tensors(module: str, got: dict) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """One MoE layer's routed-expert adapters {"gate_proj" | "up_proj" | "down_proj": (A [E, in, r], B [E, r, out])}
  -> (peft's tensors, {"<module>.gate_up_proj" | "<module>.down_proj": rank}) over transformers' fused
  gate_up_proj [E, 2I, D] ([gate; up] on the out axis) and down_proj [E, D, I]. gate and up share the input, so
  one adapter of rank r_gate + r_up holds both exactly: A = [A_gate | A_up] [E, D, r_g + r_u], B block-diagonal
  [[B_gate, 0], [0, B_up]] [E, r_g + r_u, 2I] (a zero block for a weight without an adapter): x A B = [x A_g B_g,
  x A_u B_u]. Its lora_alpha is scaled with its rank (alpha_pattern) so that alpha / r is the run's.
  peft nests two ParamWrappers on one module in parameter order: gate_up_proj's is the inner one, so its keys
  carry `.base_layer.` when down_proj is adapted too."""
  tensors, ranks = {}, {}
  inner = ".base_layer" if "down_proj" in got and ("gate_proj" in got or "up_proj" in got) else ""
  parts = [(n, got[n]) for n in ("gate_proj", "up_proj") if n in got]
  if parts:
    e, d, _ = parts[0][1][0].shape
    i = parts[0][1][1].shape[-1]
    ranks_of = [a.shape[-1] for _, (a, _) in parts]
    a = np.concatenate([a for _, (a, _) in parts], axis=-1)  # [E, D, R]
    b = np.zeros((e, sum(ranks_of), 2 * i), np.float32)  # [E, R, 2I]
    row = 0
    for (name, (_, b_w)), r in zip(parts, ranks_of):
      col = 0 if name == "gate_proj" else i
      b[:, row:row + r, col:col + i] = b_w
      row += r
    lora_a, lora_b = _expert_lora(a, b)
    tensors[f"{PEFT_PREFIX}{module}{inner}.lora_A.weight"] = lora_a
    tensors[f"{PEFT_PREFIX}{module}{inner}.lora_B.weight"] = lora_b
    ranks[f"{module}.gate_up_proj"] = sum(ranks_of)
  if "down_proj" in got:
    lora_a, lora_b = _expert_lora(*got["down_proj"])
    tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a
    tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = lora_b
    ranks[f"{module}.down_proj"] = got["down_proj"][0].shape[-1]
  return tensors, ranks


# peft on transformers v5 reads a target_modules entry ending in one of these as the routed experts (it converts
# v4 adapters of the qwen2_moe family, deepseek_v32 included, to the fused expert parameters), so the dense and
# shared-expert MLPs' linears are named by their weight in target_parameters: the same tensors, the same math.
PEFT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def peft_config(cfg: Config, modules: list[str], base_model: str | None, experts: dict[str, int] | None = None) -> dict:
  """adapter_config.json: peft's LoraConfig for the adapters `peft_tensors` writes (exact module names, so a regex
  of ours that adapts some stacks and not others is kept as it is; the MLPs' and the routed experts' fused parameters
  as target_parameters, an expert parameter of another rank than lora_rank with its rank and alpha in
  rank_pattern / alpha_pattern: the same alpha / r)."""
  experts = experts or {}
  mlp = [m for m in modules if m.rsplit(".", 1)[-1] in PEFT_EXPERT_NAMES and m not in experts]
  other = {m: r for m, r in experts.items() if r != cfg.lora_rank}
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
          "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
          "inference_mode": True, "target_modules": [m for m in modules if m not in mlp and m not in experts],
          "target_parameters": [f"{m}.weight" for m in mlp] + sorted(experts), "modules_to_save": None,
          "rank_pattern": {re.escape(m): r for m, r in other.items()},
          "alpha_pattern": {re.escape(m): cfg.lora_alpha * r / cfg.lora_rank for m, r in other.items()}}


def write_peft(item: str, cfg: Config, output: str, base_model: str | None) -> tuple[list[str], list[str]]:
  """Writes OUTPUT/adapter_config.json + adapter_model.safetensors; returns (file names, modules left out)."""
  tensors, modules, dropped, experts = peft_tensors(lora_adapters(item), cfg)
  hf_format.write_safetensors(os.path.join(output, PEFT_WEIGHTS), tensors)
  with open(os.path.join(output, PEFT_CONFIG), "w") as f:
    json.dump(peft_config(cfg, modules, base_model, experts), f, indent=2)
  return [PEFT_CONFIG, PEFT_WEIGHTS], dropped


# ---------------------------------------------------------------- the config
def export_config(checkpoint: str, config_path: str | None, overrides=()) -> Config:
  """The model's Config: --config (default: the converter's model.yml in --checkpoint) + key=value, on one
  device (the export needs no mesh)."""
  if config_path is None:
    config_path = os.path.join(checkpoint, CONFIG_FILE)
    if not os.path.isfile(config_path):
      raise FileNotFoundError(f"--checkpoint {checkpoint} has no {CONFIG_FILE}: give --config, the yml the run "
                              "was trained with (e.g. configs/base.yml), and the key=value it was trained with")
  ones = {f"ici_{a}_parallelism": 1 for a in ("pipeline", "data", "fsdp", "context", "tensor", "expert")}
  ones["dcn_pipeline_parallelism"] = 1
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


# --lora: how a LoRA run is exported: merged into the base (an fp8 base's merged weights quantized again: e4m3),
# merged into the base dequantized (a float model, --dtype: the adapters' effect kept), or peft's adapter files
LORA_FORMATS = ("merged", "merged-float", "peft")


def export(checkpoint: str, output: str, config_path: str | None = None, overrides=(), dtype: str = "bfloat16",
           max_shard_size: str = "5GB", lora: str = "merged", base_model: str | None = None
           ) -> tuple[Config, list[str], list[str]]:
  """Writes OUTPUT/config.json and the safetensors shards (a LoRA run with lora="peft": peft's adapter files
  only, base_model its base_model_name_or_path); returns the Config, the file names and the modules left out."""
  if dtype not in DTYPES:
    raise ValueError(f"--dtype {dtype}: give one of {sorted(DTYPES)}")
  if lora not in LORA_FORMATS:
    raise ValueError(f"--lora {lora}: give one of {list(LORA_FORMATS)}")
  max_bytes = parse_size(max_shard_size)
  item = find_checkpoint(checkpoint)
  cfg = export_config(checkpoint, config_path, overrides)
  floats = lora == "merged-float" and bool(cfg.lora_rank)  # the merged model written float, whatever the base's
  written = cfg.model_copy(update={"weight_quantization": "none"}) if floats else cfg
  hf_config = hf_format.config_to_hf(written, dtype)  # refuses a model HF cannot hold, before the restore
  if lora == "peft" and not cfg.lora_rank:
    raise ValueError("--lora peft: the model has lora_rank=0; give the LoRA run's config (--config "
                     "outputs/<run>/config.yml) or lora_rank=R lora_alpha=A as it was trained")
  prepare_output(output)
  if lora == "peft":
    return (cfg, *write_peft(item, cfg, output, base_model))
  tree = merged_parameters(item, cfg, requantize=not floats) if cfg.lora_rank else unstacked_parameters(item, cfg)
  remove_earlier_export(output)
  files = hf_format.write_sharded(output, hf_format.to_hf(tree, written, DTYPES[dtype]), max_bytes)
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  return cfg, files, []
