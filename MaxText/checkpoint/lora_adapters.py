"""Serving LoRA adapters: `serve_lora_adapters=[name=path, ...]` (vLLM's --lora-modules name=path) read,
checked against the served base, and stacked into the engine's params.

    config, graphdef, params, buffers, source = lora_adapters.load_or_create(config, mesh, report=log)

Each path is what train.py with lora_rank writes: a LoRA run's folder (`outputs/RUN`: its newest checkpoint
step) or one step of it (`outputs/RUN/checkpoints/N`); its adapters (params holding only lora_a / lora_b) are
read from there and its lora_rank and lora_alpha from the run's config.yml. The base is the served config's
(load_parameters_path), as for any serve. Checked at start, each failure one line naming the entry: the path
exists and holds a LoRA run's checkpoint; every adapter adapts the same linears; each adapter's A [.., in, r]
and B [.., r, out] fit the served model's kernels [.., in, out] (the base it was trained over has these shapes).

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

from MaxText.checkpoint import hf_export, model_state, run_folder
from MaxText.config.types import Config, ConfigError
from MaxText.layers import lora


@dataclasses.dataclass
class Adapter:
  name: str
  path: str  # as given
  rank: int
  alpha: float
  leaves: dict  # "linear/path/lora_a" | ".../lora_b" -> host array [.., in, r] | [.., r, out], as saved

  @classmethod
  def of(cls, name: str, path: str, rank: int, alpha: float, params: dict) -> "Adapter":
    """From a params dict nested as the model's, holding only lora_a / lora_b (what a LoRA run's checkpoint holds)."""
    return cls(name, path, rank, alpha, _flat(params))


def _flat(tree: dict, prefix: str = "") -> dict:
  """A nested params dict -> {"a/b/lora_a": leaf}."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else str(k)
    out.update(_flat(v, path) if isinstance(v, dict) else {path: v})
  return out


def _bad(name: str, path: str, what: str) -> ConfigError:
  return ConfigError(f"serve_lora_adapters entry {name}={path}: {what}")


def read(name: str, path: str) -> Adapter:
  """One entry's adapters (host arrays) and its run's lora_rank and lora_alpha; ConfigError (one line) otherwise."""
  where = "give a LoRA run's folder (outputs/RUN) or one of its checkpoint steps (outputs/RUN/checkpoints/N)"
  if not os.path.isdir(path):
    raise _bad(name, path, f"no such folder; {where}")
  try:
    item = hf_export.find_checkpoint(path)
  except FileNotFoundError:
    raise _bad(name, path, f"holds no checkpoint; {where}") from None
  step = os.path.dirname(item) if os.path.basename(item) == "state" else item
  source = run_folder.source_config(step)
  if source is None:
    raise _bad(name, path, f"no config.yml of its run beside its checkpoints (read {item}): the adapter's lora_rank "
               f"and lora_alpha are read there; {where}")
  saved = source[1]
  if not saved.get("lora_rank"):
    raise _bad(name, path, f"its run ({source[0]}) has lora_rank={saved.get('lora_rank', 0)}: not a LoRA run (serve "
               "a full fine-tune's checkpoints as load_parameters_path instead)")
  try:
    params = hf_export.restore_raw(item)["params"]
  except ValueError as e:
    raise _bad(name, path, str(e)) from None
  adapter = Adapter.of(name, path, int(saved["lora_rank"]), float(saved["lora_alpha"]), params)
  if not adapter.leaves or not all(p.rsplit("/", 1)[-1] in lora.ADAPTER_NAMES for p in adapter.leaves):
    raise _bad(name, path, f"{item} holds params other than lora_a / lora_b: not a LoRA run's checkpoint")
  return adapter


def _linears(adapter: Adapter) -> set[str]:
  return {p.rsplit("/", 1)[0] for p in adapter.leaves}


def served_config(config: Config, adapters: list[Adapter]) -> Config:
  """The served model's config: lora_rank the largest adapter rank, lora_module_path exactly the linears the
  adapters adapt (every adapter the same ones: else a ConfigError naming the entry)."""
  first = adapters[0]
  for a in adapters[1:]:
    if _linears(a) != _linears(first):
      extra, missing = sorted(_linears(a) - _linears(first)), sorted(_linears(first) - _linears(a))
      raise _bad(a.name, a.path, f"adapts other linears than entry {first.name} (" + "; ".join(
          f"{what}: {', '.join(ps[:3])}{' ...' if len(ps) > 3 else ''}" for what, ps in
          (("also", extra), ("not", missing)) if ps) + "): every served adapter adapts the same linears "
          "(lora_module_path)")
  module_path = "|".join(re.escape(p) for p in sorted(_linears(first)))
  return config.model_copy(update={"lora_rank": max(a.rank for a in adapters), "lora_module_path": module_path})


def stacked(adapters: list[Adapter], like: dict) -> dict:
  """The served model's adapters as host arrays, nested as `like` (its abstract adapters, slot-stacked:
  A [.., n, in, R], B [.., n, R, out]): slot 0 zeros, slot k adapter k-1 (rank padded, alpha/r folded into B).
  An adapter whose shapes do not fit the served kernels is a ConfigError naming the entry and the linear."""
  want = _flat(like)
  unknown = sorted(_linears(adapters[0]) - {p.rsplit("/", 1)[0] for p in want})
  if unknown:
    raise _bad(adapters[0].name, adapters[0].path, f"adapts {unknown[0]}, not a linear of the served model: trained "
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
        raise _bad(a.name, a.path, f"its {path} is {list(got.shape)} with lora_rank={a.rank}, the served model's is "
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
    raise _bad(adapters[0].name, adapters[0].path, f"does not fit the served model: {e}") from None
  host = stacked(adapters, lora.split(abs_params.to_pure_dict())[0])
  shardings = lora.split(model_state.shardings_of(cfg, mesh, abs_params, abs_buffers)[0])[0]
  return cfg, jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), host, shardings)


def load_or_create(config: Config, mesh, report=print):
  """model_state.load_or_create for the served config; with serve_lora_adapters, every entry read and checked
  first (before the base loads), then the served model (base + slot-stacked adapters) -> (its config, graphdef,
  params, buffers, source line)."""
  if not config.serve_lora_adapters:
    return (config, *model_state.load_or_create(config, mesh, report=report))
  adapters = [read(name, path) for name, path in config.served_adapters]
  cfg, slots = slots_on_mesh(config, adapters, mesh)
  graphdef, params, buffers, source = model_state.load_or_create(cfg, mesh, report=report)
  params = lora.join(slots, lora.split(params)[1])
  ranks = ", ".join(f"{a.name} (rank {a.rank}, alpha {a.alpha:g})" for a in adapters)
  return cfg, graphdef, params, buffers, (f"{source}; LoRA adapters {ranks} on {len(_linears(adapters[0]))} "
                                          f"linears, stacked at rank {cfg.lora_rank}")


__all__ = ["Adapter", "read", "served_config", "stacked", "slots_on_mesh", "load_or_create"]
