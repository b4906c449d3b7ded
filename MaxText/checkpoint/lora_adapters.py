"""A LoRA run's adapters read back: served (`serve_lora_adapters=[name=path, ...]`, vLLM's --lora-modules
name=path: read, checked against the served base, stacked into the engine's params) or continued by a new run
(`lora_restore_path=path`, MaxText's name: train.py and MaxText.rl start from them instead of B = 0).

    config, graphdef, params, buffers, source = lora_adapters.load_or_create(config, mesh, report=log)
    adapters = lora_adapters.restored(config, adapters, frozen)   # train.init_state: the adapters a run starts from

Each path is what train.py with lora_rank writes: a LoRA run's folder (`outputs/RUN`: its newest checkpoint
step) or one step of it (`outputs/RUN/checkpoints/N`); its adapters (params holding only lora_a / lora_b) are
read from there and its lora_rank and lora_alpha from the run's config.yml. The base is the served config's
(load_parameters_path), as for any serve. Checked at start, each failure one line naming the entry: the path
exists and holds a LoRA run's checkpoint; every adapter adapts the same linears; each adapter's A [.., in, r]
and B [.., r, out] fit the served model's kernels [.., in, out] (the base it was trained over has these shapes);
the base its checkpoint records (orbax_state.base_record) is the one loaded (orbax_state.check_base).

The served model is the base with every adapted linear holding the adapters slot-stacked (layers/lora_rows.py):
A [.., n, in, R], B [.., n, r, out] with n = adapters + 1; slot 0 zeros (no adapter); slot k the k-th entry, its
rank r_k padded with zeros to the largest R (zero columns of A and rows of B add nothing) and its alpha_k / r_k
folded into B. Its config is the served config with lora_rank R and lora_module_path naming those linears.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np

from MaxText.checkpoint import hf_export, model_state, orbax_state, run_folder
from MaxText.config.types import Config, ConfigError
from MaxText.layers import lora
from MaxText.runtime import distributed


@dataclasses.dataclass
class Adapter:
  name: str
  path: str  # as given
  rank: int
  alpha: float
  leaves: dict  # "linear/path/lora_a" | ".../lora_b" -> host array [.., in, r] | [.., r, out], as saved
  where: str = ""  # how error lines name it: "serve_lora_adapters entry NAME=PATH" or "lora_restore_path=PATH"
  base: dict | None = None  # the base its checkpoint records (orbax_state.base_record), None for older ones
  saved: dict = dataclasses.field(default_factory=dict)  # its run's config.yml

  def __post_init__(self):
    self.where = self.where or f"serve_lora_adapters entry {self.name}={self.path}"

  @classmethod
  def of(cls, name: str, path: str, rank: int, alpha: float, params: dict, **kw) -> "Adapter":
    """From a params dict nested as the model's, holding only lora_a / lora_b (what a LoRA run's checkpoint holds)."""
    return cls(name, path, rank, alpha, _flat(params), **kw)


def _flat(tree: dict, prefix: str = "") -> dict:
  """A nested params dict -> {"a/b/lora_a": leaf}."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else str(k)
    out.update(_flat(v, path) if isinstance(v, dict) else {path: v})
  return out


def _bad(where: str, what: str) -> ConfigError:
  return ConfigError(f"{where}: {what}")


def read(name: str, path: str, where: str = "") -> Adapter:
  """One entry's adapters (host arrays), its run's lora_rank, lora_alpha and config.yml, and the base its checkpoint
  records; ConfigError (one line, starting with `where`: default the serve_lora_adapters entry) otherwise."""
  where = where or f"serve_lora_adapters entry {name}={path}"
  give = "give a LoRA run's folder (outputs/RUN) or one of its checkpoint steps (outputs/RUN/checkpoints/N)"
  if not os.path.isdir(path):
    raise _bad(where, f"no such folder; {give}")
  try:
    item = hf_export.find_checkpoint(path)
  except FileNotFoundError:
    raise _bad(where, f"holds no checkpoint; {give}") from None
  step = os.path.dirname(item) if os.path.basename(item) == "state" else item
  source = run_folder.source_config(step)
  if source is None:
    raise _bad(where, f"no config.yml of its run beside its checkpoints (read {item}): the adapter's lora_rank "
               f"and lora_alpha are read there; {give}")
  saved = source[1]
  if not saved.get("lora_rank"):
    raise _bad(where, f"its run ({source[0]}) has lora_rank={saved.get('lora_rank', 0)}: not a LoRA run (give "
               "a full fine-tune's checkpoints as load_parameters_path instead)")
  try:
    params = hf_export.restore_raw(item)["params"]
  except ValueError as e:
    raise _bad(where, str(e)) from None
  adapter = Adapter.of(name, path, int(saved["lora_rank"]), float(saved["lora_alpha"]), params, where=where,
                       base=orbax_state.step_base_record(step), saved=saved)
  if not adapter.leaves or not all(p.rsplit("/", 1)[-1] in lora.ADAPTER_NAMES for p in adapter.leaves):
    raise _bad(where, f"{item} holds params other than lora_a / lora_b: not a LoRA run's checkpoint")
  return adapter


def _linears(adapter: Adapter | dict) -> set[str]:
  """The linears an adapter (or a flat dict of adapter leaves, "linear/path/lora_a" -> ...) adapts."""
  return {p.rsplit("/", 1)[0] for p in (adapter.leaves if isinstance(adapter, Adapter) else adapter)}


def _differ(extra: list[str], missing: list[str]) -> str:
  """'also: a, b; not: c ...': the linears one adapter has beyond another's and lacks."""
  return "; ".join(f"{what}: {', '.join(ps[:3])}{' ...' if len(ps) > 3 else ''}"
                   for what, ps in (("also", extra), ("not", missing)) if ps)


def served_config(config: Config, adapters: list[Adapter]) -> Config:
  """The served model's config: lora_rank the largest adapter rank, lora_module_path exactly the linears the
  adapters adapt (every adapter the same ones: else a ConfigError naming the entry)."""
  first = adapters[0]
  for a in adapters[1:]:
    if _linears(a) != _linears(first):
      extra, missing = sorted(_linears(a) - _linears(first)), sorted(_linears(first) - _linears(a))
      raise _bad(a.where, f"adapts other linears than entry {first.name} ({_differ(extra, missing)}): every served "
                 "adapter adapts the same linears (lora_module_path)")
  module_path = "|".join(re.escape(p) for p in sorted(_linears(first)))
  return config.model_copy(update={"lora_rank": max(a.rank for a in adapters), "lora_module_path": module_path})


def stacked(adapters: list[Adapter], like: dict) -> dict:
  """The served model's adapters as host arrays, nested as `like` (its abstract adapters, slot-stacked:
  A [.., n, in, R], B [.., n, R, out]): slot 0 zeros, slot k adapter k-1 (rank padded, alpha/r folded into B).
  An adapter whose shapes do not fit the served kernels is a ConfigError naming the entry and the linear."""
  want = _flat(like)
  unknown = sorted(_linears(adapters[0]) - _linears(want))
  if unknown:
    raise _bad(adapters[0].where, f"adapts {unknown[0]}, not a linear of the served model: trained "
               "over another model (check model_name and the model keys)")
  out = {}
  for path, spec in want.items():
    arr = np.zeros(spec.shape, np.float32)  # [.., n, in, R] | [.., n, R, out]
    is_a = path.endswith("lora_a")
    for k, a in enumerate(adapters, start=1):
      got = np.asarray(a.leaves[path], np.float32)  # [.., in, r] | [.., r, out]
      stack = spec.shape[:-3]
      fits = got.shape == ((*stack, spec.shape[-2], a.rank) if is_a else (*stack, a.rank, spec.shape[-1]))
      if not fits:
        shape = [*stack, spec.shape[-2], "r"] if is_a else [*stack, "r", spec.shape[-1]]
        raise _bad(a.where, f"its {path} is {list(got.shape)} with lora_rank={a.rank}, the served model's is "
                   f"[{', '.join(map(str, shape))}]: trained over another base (check model_name, the model keys "
                   "and load_parameters_path)")
      if is_a:
        arr[..., k, :, :a.rank] = got
      else:
        arr[..., k, :a.rank, :] = got * np.float32(a.alpha / a.rank)
    out[path] = arr
  return _nest(out)


def _nest(flat: dict) -> dict:
  out: dict = {}
  for path, v in flat.items():
    *keys, last = path.split("/")
    node = out
    for k in keys:
      node = node.setdefault(int(k) if k.isdigit() else k, {})
    node[last] = v
  return out


def slots_on_mesh(config: Config, adapters: list[Adapter], mesh) -> tuple[Config, dict]:
  """(the served config, the served model's slot-stacked adapters on the mesh, sharded as its abstract model says);
  a ConfigError naming the entry when they do not fit the model `config` describes. Join them with the base's params
  (lora.join) for the served model's."""
  cfg = served_config(config, adapters)
  try:
    _, abs_params, abs_buffers = model_state.abstract_model(cfg)
  except ConfigError as e:  # e.g. its linears are none of this model's
    raise _bad(adapters[0].where, f"does not fit the served model: {e}") from None
  host = stacked(adapters, lora.split(abs_params.to_pure_dict())[0])
  shardings = lora.split(model_state.shardings_of(cfg, mesh, abs_params, abs_buffers)[0])[0]
  return cfg, distributed.from_host_copy(host, shardings)


def load_or_create(config: Config, mesh, report=print):
  """model_state.load_or_create for the served config; with serve_lora_adapters, every entry read and checked
  first (before the base loads), then the served model (base + slot-stacked adapters) -> (its config, graphdef,
  params, buffers, source line)."""
  if not config.serve_lora_adapters:
    return (config, *model_state.load_or_create(config, mesh, report=report))
  adapters = [read(name, path) for name, path in config.served_adapters]
  cfg, slots = slots_on_mesh(config, adapters, mesh)
  graphdef, params, buffers, source = model_state.load_or_create(cfg, mesh, report=report)
  base = lora.split(params)[1]
  fingerprint = int(orbax_state.base_fingerprint(lora.join(base, buffers)))  # as train.py's FROZEN: base + buffers
  for a in adapters:
    orbax_state.check_base(a.base, fingerprint, config.load_parameters_path, a.where, config.lora_check_base)
  params = lora.join(slots, base)
  ranks = ", ".join(f"{a.name} (rank {a.rank}, alpha {a.alpha:g})" for a in adapters)
  return cfg, graphdef, params, buffers, (f"{source}; LoRA adapters {ranks} on {len(_linears(adapters[0]))} "
                                          f"linears, stacked at rank {cfg.lora_rank}")


def restored(config: Config, like: dict, frozen: dict, report=print) -> dict:
  """The adapters a LoRA run starts from (train.init_state; `like`: its fresh adapters on the mesh, B = 0; `frozen`:
  its base as loaded). Its own checkpoints hold a base record: the base must be that one (check_base), and the resume
  (orbax_state.restore_newest_good) replaces the adapters, so `like` comes back (lora_restore_path is MaxText's: for a
  fresh run only; a refused resume leaves the run's config.yml naming the run's base, as before it). Else with
  lora_restore_path: that run's adapters on `like`'s shardings, after one ConfigError
  line naming the key for a lora_rank, lora_alpha or lora_module_path other than its run's, or another base."""
  latest = orbax_state.latest_step_on_disk(config) if config.enable_checkpointing else None
  if latest is None and not config.lora_restore_path:
    return like
  fingerprint = int(orbax_state.base_fingerprint(frozen))
  if latest is not None:
    step_dir = os.path.join(config.checkpoint_dir, str(latest))
    record = orbax_state.step_base_record(step_dir)
    try:
      orbax_state.check_base(record, fingerprint, config.load_parameters_path,
                             f"run_name={config.run_name}'s checkpoint step {latest} ({step_dir})", config.lora_check_base)
    except ConfigError:  # this start wrote config.yml (RunFolder.open): let it name the run's base again
      if jax.process_index() == 0:
        run_folder.RunFolder(config.model_copy(update={"load_parameters_path": record["load_parameters_path"]})
                             ).write_config()
      raise
    if config.lora_restore_path:
      report(f"lora_restore_path={config.lora_restore_path} is not read: the run resumes from its own checkpoints")
    return like
  key = f"lora_restore_path={config.lora_restore_path}"
  a = read("", config.lora_restore_path, where=key)
  for name, theirs, ours in (("lora_rank", a.rank, config.lora_rank), ("lora_alpha", a.alpha, config.lora_alpha)):
    if theirs != ours:
      raise _bad(key, f"its run trained at {name}={theirs:g}, this config has {name}={ours:g}: set {name}={theirs:g} "
                 "(adapters continue as they trained)")
  want = _flat(like)
  extra, missing = sorted(_linears(a) - _linears(want)), sorted(_linears(want) - _linears(a))
  if extra or missing:
    raise _bad(key, f"adapts other linears than lora_module_path={config.lora_module_path!r} ({_differ(extra, missing)})"
               f": set lora_module_path={a.saved.get('lora_module_path')!r}, its run's")
  orbax_state.check_base(a.base, fingerprint, config.load_parameters_path, key, config.lora_check_base)
  host = {}
  for path, spec in want.items():
    host[path] = np.asarray(a.leaves[path], spec.dtype)
    if host[path].shape != spec.shape:
      raise _bad(key, f"its {path} is {list(host[path].shape)}, this model's is {list(spec.shape)}: trained over "
                 "another model (check model_name, the model keys and load_parameters_path)")
  out = distributed.from_host_copy(host, {path: spec.sharding for path, spec in want.items()})
  report(f"LoRA adapters from {key} ({len(_linears(a))} linears, rank {a.rank}, alpha {a.alpha:g}): a new run (step "
         "0, fresh optimizer)")
  return _nest(out)


__all__ = ["Adapter", "read", "served_config", "stacked", "slots_on_mesh", "load_or_create", "restored"]
