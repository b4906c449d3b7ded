"""A run's folder, `<base_output_directory>/<run_name>/`: its config, checkpoints, events, profiles.

    run = RunFolder(config)
    run.open(latest_step)   # checks the folder is writable and that a resumed run is the same run;
                            # writes config.yml; returns False when the run is already finished

`config.yml` (the resolved config, written at every start) is what a later start compares with: a
run resumes only with the same model-shape and data keys (`RESUME_KEYS`); anything else trains
another model on other data and needs its own run_name. Its paths (pyconfig.PATH_KEYS: tokenizer,
data, chat template, parameters) are written absolute, so `python -m MaxText.serve <run>/config.yml`
and decode.py read the same files from any directory (docs/serving_a_run.md).
"""

from __future__ import annotations

import os

import jax
import yaml

from MaxText.config import pyconfig
from MaxText.config.types import Config, ConfigError
from MaxText.runtime.cli import RunError

# Keys a resumed run must share with the run that wrote the checkpoints: the parameter and optimizer
# trees (model shape, which parameters train), and which batches come next (data).
RESUME_KEYS = (
    "vocab_size", "emb_dim", "mlp_dim", "num_decoder_layers", "first_num_dense_layers", "weight_dtype", "scan_layers",
    "attention_type", "num_query_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "use_indexer", "indexer_n_heads", "indexer_head_dim", "indexer_training_stage", "num_experts",
    "shared_experts", "moe_mlp_dim", "routed_bias", "mtp_num_layers",
    "dataset_type", "dataset_path", "jsonl_text_field", "tokenizer_type", "tokenizer_path", "add_bos", "add_eos",
    "pad_id", "bos_id", "eos_id", "seed", "global_batch_size", "max_target_length",
    "grain_train_files", "grain_file_type", "hf_path", "train_data_columns", "tokenize_train_data", "use_sft",
    "sft_train_on_completion_only", "lora_rank", "lora_alpha", "lora_module_path",
)
# Data keys of dataset_type=synthetic_retrieval alone (other data ignores them).
RETRIEVAL_RESUME_KEYS = ("retrieval_pairs", "retrieval_queries", "retrieval_keys", "retrieval_values",
                         "retrieval_pair_tokens")


def source_config(load_parameters_path: str) -> tuple[str, dict] | None:
  """(its path, the config.yml) of the run whose checkpoints load_parameters_path names (<run>/checkpoints
  or one step, <run>/checkpoints/<step>), or None: a converter output, or no readable config.yml there."""
  here = os.path.abspath(load_parameters_path.rstrip("/")) if load_parameters_path else ""
  checkpoints = here if os.path.basename(here) == "checkpoints" else os.path.dirname(here)
  path = os.path.join(os.path.dirname(checkpoints), "config.yml")
  if not (here and os.path.basename(checkpoints) == "checkpoints" and os.path.isfile(path)):
    return None
  try:
    with open(path) as f:
      saved = yaml.safe_load(f)
  except (OSError, yaml.YAMLError):
    return None
  return (path, saved) if isinstance(saved, dict) else None


class RunFolderError(RunError):
  """The run folder cannot be written, or holds another run: one line says which key or path."""


class ResumeMismatchError(ConfigError):
  """A run resumed with other model-shape or data keys than it was started with (a config mistake: exit 2)."""


class RunFolder:

  def __init__(self, config: Config):
    self.config = config
    self.path = config.run_dir
    self.config_path = os.path.join(self.path, "config.yml")

  def saved_config(self) -> dict | None:
    if not os.path.isfile(self.config_path):
      return None
    try:
      with open(self.config_path) as f:
        saved = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
      raise RunFolderError(f"cannot read {self.config_path}: {e}; move it away to resume without the check") from None
    return saved if isinstance(saved, dict) else None

  def check_same_run(self, latest_step: int) -> None:
    """A resumed run must keep the keys that shape its checkpoints and its data."""
    saved = self.saved_config()
    if saved is None:
      return
    saved = pyconfig.absolute_paths(saved)  # a run written with relative paths: as this directory reads them
    now = yaml.safe_load(pyconfig.to_yaml(self.config, absolute=True))
    keys = RESUME_KEYS + (RETRIEVAL_RESUME_KEYS if now["dataset_type"] == "synthetic_retrieval" else ())
    changed = [k for k in keys if k in saved and saved[k] != now[k]]
    if changed:
      diffs = ", ".join(f"{k}={saved[k]!r} in the run, {now[k]!r} now" for k in changed)
      raise ResumeMismatchError(f"run_name={self.config.run_name!r} ({self.path}) holds checkpoints up to step "
                           f"{latest_step} of another model or data: {diffs}; choose another run_name "
                           f"(or keep {', '.join(changed)} as the run had them)")

  def open(self, latest_step: int | None) -> bool:
    """Checks and writes config.yml. False when the run has reached `steps` (said on the console)."""
    if latest_step is not None:
      self.check_same_run(latest_step)
      if latest_step >= self.config.steps:
        print(f"run {self.config.run_name!r} is finished: its checkpoint step {latest_step} reached steps="
              f"{self.config.steps} ({self.config.checkpoint_dir}). To train on, raise steps (e.g. steps="
              f"{latest_step + self.config.steps}); to start over, choose another run_name. The weights: "
              f"load_parameters_path={self.config.checkpoint_dir}", flush=True)
        return False
    if jax.process_index() == 0:  # one writer for the whole (multi-process) run
      self.write_config()
    return True

  def write_config(self) -> None:
    try:
      os.makedirs(self.path, exist_ok=True)
      with open(self.config_path, "w") as f:
        f.write(pyconfig.to_yaml(self.config, absolute=True))
    except OSError as e:
      raise RunFolderError(f"cannot write the run folder {self.path} ({e.strerror}: {e.filename}); set "
                           "base_output_directory to a writable folder with free space") from None

  def describe(self) -> str:
    c = self.config
    parts = [f"run {self.path}: config {self.config_path}"]
    parts.append(f"checkpoints {c.checkpoint_dir} (every {c.checkpoint_period} steps)" if c.enable_checkpointing
                 else "checkpoints off (enable_checkpointing=false)")
    parts.append(f"tensorboard --logdir {c.tensorboard_dir}" if c.enable_tensorboard else "tensorboard off")
    return "; ".join(parts)
