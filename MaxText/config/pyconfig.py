"""Builds the frozen Config: base.yml -> configs/models/<model_name>.yml -> argv[1] -> key=value.

    config = pyconfig.initialize(["train.py", "base.yml", "indexer_topk=8"])
    config = pyconfig.initialize(argv, indexer_topk=8)   # keyword overrides win over argv

`python -m MaxText.config base.yml key=value ...` prints the resolved config (a dry run).
Every user mistake raises `ConfigError` with a message that names the key, the value and
what is allowed; `initialize_or_exit` turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
from typing import Any, Callable, Sequence

import pydantic
import yaml
from omegaconf import OmegaConf

from MaxText.config.types import MESH_AXIS_KEYS, SECTIONS, Config, ConfigError, Distributed, schema_keys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # MaxText/config/ -> repo
CONFIGS_DIR = os.path.join(REPO_ROOT, "configs")
BASE_YML = os.path.join(CONFIGS_DIR, "base.yml")


def resolve_config_path(name: str) -> str:
  """A path that exists as given, else a bare name under configs/ (with or without .yml)."""
  for cand in (name, os.path.join(CONFIGS_DIR, name), os.path.join(CONFIGS_DIR, name + ".yml")):
    if os.path.isfile(cand):
      return cand
  raise ConfigError(f"config file '{name}' not found (looked for it as a path and under {CONFIGS_DIR}/)")


def _load_yaml(path: str) -> dict[str, Any]:
  try:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
  except Exception as e:  # yaml syntax errors, unresolvable interpolations
    raise ConfigError(f"cannot read config file {path}: {e}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path} must hold a mapping of key: value, got {type(data).__name__}")
  return data


@functools.lru_cache(maxsize=None)
def _base_values() -> tuple:
  return tuple(_load_yaml(BASE_YML).items())


def default(key: str) -> Any:
  """base.yml's value of `key` (the one place defaults live), e.g. to tell a key left at its default from one set."""
  return dict(_base_values())[key]


def _check_keys(keys, where: str) -> None:
  valid = schema_keys()
  for key in keys:
    if key not in valid:
      near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
      hint = f"; did you mean '{near[0]}'?" if near else ""
      raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def _parse_overrides(args: Sequence[str]) -> dict[str, Any]:
  for a in args:
    if "=" not in a or a.startswith("="):
      raise ConfigError(f"argument '{a}' is not of the form key=value")
  try:
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist(list(args)), resolve=True)
  except Exception as e:
    raise ConfigError(f"cannot parse command-line overrides {list(args)}: {e}") from None
  return parsed


def _model_yml(model_name: str) -> dict[str, Any]:
  if model_name == "default":
    return {}
  path = os.path.join(CONFIGS_DIR, "models", model_name + ".yml")
  if not os.path.isfile(path):
    have = sorted(f[:-4] for f in os.listdir(os.path.join(CONFIGS_DIR, "models")) if f.endswith(".yml"))
    raise ConfigError(f"model_name='{model_name}' has no configs/models/{model_name}.yml; known models: {have}")
  data = _load_yaml(path)
  _check_keys(data, f"configs/models/{model_name}.yml")
  if "model_name" in data:
    raise ConfigError(f"configs/models/{model_name}.yml must not set model_name")
  return data


def _format_validation_error(err: pydantic.ValidationError, raw: dict[str, Any]) -> str:
  lines = []
  for e in err.errors():
    loc = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if loc:
      key = str(e["loc"][0])
      if e["type"] == "missing":
        lines.append(f"config key '{key}' is missing (every key needs a value in configs/base.yml)")
      else:
        lines.append(f"config key '{loc}' = {raw.get(key, e.get('input'))!r}: {msg}")
    else:
      lines.append(msg)
  return "; ".join(lines)


def _resolve_mesh(values: dict[str, Any], num_devices: int) -> None:
  """Fills one ici_*_parallelism=-1 from the device count and checks the product (the stage axis is
  ici_pipeline_parallelism x dcn_pipeline_parallelism, never filled)."""
  axes = list(values["mesh_axes"])
  keys = [MESH_AXIS_KEYS.get(a, f"ici_{a}_parallelism") for a in axes]
  sizes = {k: values[k] for k in keys}
  if "ici_pipeline_parallelism" in sizes and isinstance(values.get("dcn_pipeline_parallelism"), int):
    sizes["ici_pipeline_parallelism"] *= values["dcn_pipeline_parallelism"]
  fill = [k for k, v in sizes.items() if v == -1]
  if len(fill) > 1:
    raise ConfigError(f"only one mesh axis may be -1, got {fill}")
  for k, v in sizes.items():
    if v == 0:
      raise ConfigError(f"config key '{k}' = 0: a mesh axis size must be >= 1 (or -1 to fill)")
  known = 1
  for k, v in sizes.items():
    if v != -1:
      known *= v
  if fill:
    if num_devices % known:
      raise ConfigError(f"the mesh axes {', '.join(f'{k}={v}' for k, v in sizes.items() if v != -1)} "
                        f"(product {known}) do not divide the {num_devices} devices, so {fill[0]}=-1 cannot be filled")
    values[fill[0]] = num_devices // known
  elif known != num_devices:
    raise ConfigError(f"the mesh axes {', '.join(f'{k}={v}' for k, v in sizes.items())} multiply to {known}, "
                      f"but there are {num_devices} devices")


def _check_with_devices(cfg: Config) -> None:
  cp = cfg.ici_context_parallelism
  if cp > 1:
    div = 2 * cp if cfg.context_parallel_load_balance else cp
    if cfg.max_target_length % div:
      why = " (2 x ici_context_parallelism with context_parallel_load_balance=true)" if div != cp else ""
      raise ConfigError(f"max_target_length={cfg.max_target_length} is not divisible by {div}{why}; "
                        f"ici_context_parallelism={cp} shards the sequence")
  # stage splits the batch only outside the pipelined stack, and only where it divides (sharding.logical_to_spec)
  batch_axes = [a for a in dict(cfg.logical_axis_rules).get("activation_batch", ()) if a != "stage"]
  shards = 1
  for a in batch_axes:
    shards *= cfg.mesh_shape[a]
  micro = cfg.global_batch_size // cfg.gradient_accumulation_steps
  if cfg.pipeline_stages > 1 and (micro // cfg.pipeline_microbatches) % shards:
    raise ConfigError(f"{micro} rows / num_pipeline_microbatches={cfg.pipeline_microbatches} = "
                      f"{micro // cfg.pipeline_microbatches} rows per pipeline microbatch, not divisible by the {shards} "
                      f"batch shards (mesh axes {list(batch_axes)}); raise global_batch_size or lower the microbatches")
  if micro % shards:
    raise ConfigError(f"global_batch_size={cfg.global_batch_size} / gradient_accumulation_steps="
                      f"{cfg.gradient_accumulation_steps} = {micro} sequences per micro-batch, not divisible by the "
                      f"{shards} batch shards (mesh axes {list(batch_axes)}: "
                      f"{', '.join(f'ici_{a}_parallelism={cfg.mesh_shape[a]}' for a in batch_axes)})")


def merged_values(argv: Sequence[str], **overrides: Any) -> dict[str, Any]:
  """base.yml -> model yml -> the user's yml -> key=value -> overrides, keys checked, not yet validated."""
  argv = list(argv)
  if len(argv) < 2:
    raise ConfigError("usage: <program> <config.yml | base.yml> [key=value ...]")
  values = _load_yaml(BASE_YML)
  known_names = [rule[0] for rule in values["logical_axis_rules"]]
  path = resolve_config_path(argv[1])
  extra = {}
  if os.path.abspath(path) != os.path.abspath(BASE_YML):
    extra = _load_yaml(path)
    _check_keys(extra, path)
  cli = _parse_overrides(argv[2:])
  _check_keys(cli, "the command line")
  _check_keys(overrides, "the keyword overrides")
  model_name = {**values, **extra, **cli, **overrides}.get("model_name", "default")
  values.update(_model_yml(str(model_name)))  # the model file, then the user's own file and the CLI over it
  values.update(extra)
  values.update(cli)
  values.update(overrides)
  values["model_name"] = model_name
  _check_logical_names(values["logical_axis_rules"], known_names)
  return values


def _check_logical_names(rules: Any, known: list[str]) -> None:
  """Every logical name a rule maps is one the layers use (base.yml's rules list them all): a
  misspelt name would otherwise leave its axis replicated without a word."""
  if not isinstance(rules, (list, tuple)):
    return  # the schema names the shape it wants
  for rule in rules:
    name = rule[0] if isinstance(rule, (list, tuple)) and rule else rule
    if isinstance(name, str) and name not in known:
      raise ConfigError(f"logical_axis_rules maps '{name}', a logical axis no layer uses; "
                        f"the known names (configs/base.yml): {', '.join(known)}")


def initialize(argv: Sequence[str], num_devices: int | Callable[[Distributed], int] | None = None,
               **overrides: Any) -> Config:
  """argv[0] is the program, argv[1] a YAML path or bare name, the rest key=value.

  num_devices sizes the mesh: a count; a function of the Distributed keys that returns one (an entry
  point passes runtime.distributed.initialize, which first joins the other processes); or None,
  the devices this process sees (jax.device_count())."""
  values = merged_values(argv, **overrides)
  try:
    if callable(num_devices):
      num_devices = num_devices(Distributed(**{k: values[k] for k in Distributed.model_fields}))
    elif num_devices is None:
      import jax  # only here: the rest of the config system does not need jax
      num_devices = jax.device_count()
    _resolve_mesh(values, num_devices)
    cfg = Config(**values)
  except pydantic.ValidationError as e:
    raise ConfigError(_format_validation_error(e, values)) from None
  except (TypeError, KeyError) as e:
    raise ConfigError(f"invalid config: {e}") from None
  _check_with_devices(cfg)
  return cfg


def usage(program: str, doc: str | None = None) -> str:
  """The --help text of an entry point: its docstring, the key=value convention, where keys are documented."""
  head = (doc or "").strip()
  return (f"{head}\n\n" if head else "") + f"""usage: {program} <config.yml> [key=value ...]
  <config.yml>  configs/base.yml, a bare name under configs/ (base.yml), or your own YAML file
                (it layers over base.yml)
  key=value     sets any config key, typed as YAML: steps=300 use_indexer=false mesh_axes=[data,fsdp]
Order: configs/base.yml -> configs/models/<model_name>.yml -> your YAML -> key=value.
Every key, its default and a one-line comment: {BASE_YML}
Print the resolved config without running anything: python -m MaxText.config configs/base.yml [key=value ...]
Errors are one line; MAXTEXT_TRACEBACK=1 shows the traceback behind one."""


def initialize_or_exit(argv: Sequence[str], doc: str | None = None,
                       num_devices: int | Callable[[Distributed], int] | None = None, **overrides: Any) -> Config:
  """For entry points: -h/--help prints `usage` (with `doc`) and exits 0; a config mistake prints
  one line and exits 2, no traceback. num_devices as for `initialize`."""
  if any(a in ("-h", "--help") for a in argv[1:]):
    print(usage(f"python {os.path.relpath(argv[0])}" if argv[0].endswith(".py") else argv[0], doc))
    sys.exit(0)
  try:
    return initialize(argv, num_devices, **overrides)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)


# Keys holding local paths (a glob, or comma-separated globs, for the grain keys). Relative ones are
# relative to the directory a command runs in; a run folder's config.yml holds them absolute.
PATH_KEYS = ("base_output_directory", "jax_cache_dir", "dataset_path", "grain_train_files", "grain_eval_files",
             "hf_path", "hf_eval_files", "eval_dataset_path", "tokenizer_path", "load_parameters_path",
             "chat_template_path", "lora_restore_path")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
  """values with each PATH_KEYS value made absolute against the current directory (each of a
  comma-separated list; "", "~/..." and URLs as they are), so the file serves from any directory."""
  def one(p: str) -> str:
    p = p.strip()
    return p if not p or os.path.isabs(p) or p.startswith("~") or "://" in p else os.path.abspath(p)
  return {k: ",".join(map(one, v.split(","))) if k in PATH_KEYS and isinstance(v, str) else v
          for k, v in values.items()}


def to_yaml(cfg: Config, absolute: bool = False) -> str:
  """The resolved config as YAML, every key in schema order (absolute: PATH_KEYS absolute_paths'); a secret
  (serve_api_key) is written as "": never echoed or saved."""
  def plain(v):
    if isinstance(v, pydantic.SecretStr):
      return ""
    return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
  ordered = {k: plain(getattr(cfg, k)) for section in SECTIONS for k in section.model_fields}
  return yaml.safe_dump(absolute_paths(ordered) if absolute else ordered, sort_keys=False, width=120)
