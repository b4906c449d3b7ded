"""Orbax checkpoints of the whole train state (params, buffers, optimizer, step) and the data position.

A run's `checkpoints/<step>/` holds three items: `state` (the train state), `data` (the data
iterator's JSON state) and `meta` (fingerprints of the state's bits: the whole state's, and its params +
buffers' for a parameter-only load). Restoring checks the fingerprint and that every value is finite; a checkpoint that fails either, or fails to read, is
reported in one line, moved to `<run>/checkpoints_unusable/` and the one before it is used.

A LoRA run's checkpoint holds adapters only; its meta also records the base they were trained over
(`base_record`: the run's load_parameters_path and `base_fingerprint` of the frozen base), so that adapters
are never resumed, continued, served or merged over another base (`check_base`).

`restore_parameters` reads params + buffers from any checkpoint this project writes: a converter
output (a parameter-only tree), a run's `checkpoints` folder (its newest usable step), one step
folder, or its `state` subfolder (a run folder itself works too). A run's step is checked against its
parameters' fingerprint (a converter output has none: finiteness only).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from MaxText.checkpoint import read_scope, run_folder
from MaxText.config.types import Config, ConfigError
from MaxText.runtime.cli import RunError
from MaxText.runtime.distributed import settled
from MaxText.runtime.metrics import warn

UNUSABLE_DIR = "checkpoints_unusable"


class CheckpointError(RunError):
  """A checkpoint is missing, unreadable, corrupt or of another model: one line says which and why."""


def one_line(e: BaseException) -> str:
  """The root cause of an exception, on one line (orbax/tensorstore messages span pages)."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def latest_step_on_disk(config: Config) -> int | None:
  """The newest step folder in the run's checkpoints folder (read before any orbax object exists)."""
  steps = _steps_in(config.checkpoint_dir) if os.path.isdir(config.checkpoint_dir) else []
  return steps[0] if steps else None


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.max_checkpoints_to_keep, enable_async_checkpointing=config.async_checkpointing,
      create=True)
  try:
    return ocp.CheckpointManager(os.path.abspath(config.checkpoint_dir), options=options)
  except OSError as e:
    raise CheckpointError(f"cannot create the checkpoint folder {config.checkpoint_dir}: {e.strerror}; "
                          "set base_output_directory to a writable folder") from None


@jax.jit
def state_check(tree):
  """(fingerprint, finite): a uint32 sum of every leaf's bits (a flipped bit changes it) and
  whether every floating value is finite. One small program, run at save and at restore."""
  total, finite = jnp.uint32(0), jnp.bool_(True)
  for i, x in enumerate(jax.tree.leaves(tree)):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    total = total + jnp.sum(bits, dtype=jnp.uint32) * jnp.uint32(2 * i + 1)  # odd weight: no change cancels
    if jnp.issubdtype(x.dtype, jnp.floating):
      finite = finite & jnp.all(jnp.isfinite(x))
  return total, finite


def parameters_of(state: dict) -> dict:
  """The part of a state a parameter-only load reads: {"params", "buffers"} (the same tree restore_parameters
  restores, so the same leaves in the same order feed state_check)."""
  return {"params": state["params"], "buffers": state.get("buffers", {})}


FROZEN = "frozen"  # a train state's frozen part (LoRA's base, from load_parameters_path): never checkpointed


@jax.jit
def base_fingerprint(frozen) -> jax.Array:
  """uint32: state_check's fingerprint of a LoRA base (its params and routing biases, nested and stacked as the
  train state's FROZEN entry holds them) with every float wider than 16 bits rounded to bfloat16 first.
  Invariant: the same checkpoint loaded with the same model keys gives the same fingerprint on any mesh (an
  integer sum), whether weight_dtype is float32 or bfloat16 (both round to the same bf16 bits); another base (other
  weights, another step of a run, another seed) gives another one but for a 2**-32 chance. Cost: one read of the
  base's bytes (no copy: the cast fuses into the sum)."""
  def narrow(x):
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 2 else x
  return state_check(jax.tree.map(narrow, frozen))[0]


def base_record(frozen, checkpoint_dir: str) -> dict:
  """What a LoRA checkpoint's meta says of its base: {"fingerprint": base_fingerprint(frozen), "load_parameters_path":
  as the run's config.yml beside `checkpoint_dir` names it (absolute), "" when it has none}."""
  source = run_folder.source_config(checkpoint_dir)
  path = (source[1].get("load_parameters_path") or "") if source is not None else ""
  return {"fingerprint": int(settled(base_fingerprint(frozen))), "load_parameters_path": path}


def step_base_record(step_dir: str) -> dict | None:
  """The base record saved with a LoRA checkpoint step (<step>/meta), or None (not a LoRA run's, or written before
  base records)."""
  meta = _step_meta(os.path.join(step_dir, "state"))
  return None if meta is None else meta.get("base")


def check_base(record: dict | None, fingerprint: int, load_parameters_path: str, whose: str,
               enforce: bool = True) -> None:
  """A ConfigError (one line) when a LoRA checkpoint's base `record` is not the base loaded now (`fingerprint` from
  load_parameters_path): adapters over another base compute garbage. No record (older checkpoints): no check.
  enforce=False (lora_check_base=false): the same line as a warning, and the adapters are used."""
  if record is None or int(record["fingerprint"]) == int(fingerprint):
    return
  was = record.get("load_parameters_path") or "(random init)"
  said = (f"load_parameters_path={load_parameters_path or '(random init)'} is not the base {whose} was trained "
          f"over: load_parameters_path={was} (base fingerprint {int(record['fingerprint']):#010x}; this one "
          f"{int(fingerprint):#010x})")
  if not enforce:
    warn(f"{said}; used anyway (lora_check_base=false)")
    return
  raise ConfigError(f"{said}; give load_parameters_path={was}, or the same base's copy (lora_check_base=false uses "
                    "the adapters over this one anyway)")


def checkpointed(state: dict) -> dict:
  """The part of a train state a checkpoint holds: all of it but FROZEN."""
  return {k: v for k, v in state.items() if k != FROZEN}


def save(manager: ocp.CheckpointManager, step: int, state: dict, data_state: dict) -> None:
  """Writes `state` (the data iterator's JSON beside it) as `step`, with meta = {"fingerprint": the whole state's,
  "parameters_fingerprint": parameters_of(state)'s}: a resume checks the first, load_parameters_path the second.
  A FROZEN entry (a LoRA run's base) is left out (`checkpointed`), recorded as meta["base"] (`base_record`)."""
  base = base_record(state[FROZEN], str(manager.directory)) if FROZEN in state else None
  state = checkpointed(state)
  fingerprint, _ = settled(state_check(state))  # settled: one collective program at a time (distributed.settled)
  meta = {"fingerprint": int(fingerprint)}
  if base is not None:
    meta["base"] = base
  if "params" in state:
    meta["parameters_fingerprint"] = int(settled(state_check(parameters_of(state)))[0])
  try:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave(data_state),
                                               meta=ocp.args.JsonSave(meta)),
                 force=True)
  except Exception as e:  # a full disk, a folder made read-only under us: one line, not orbax's pages
    raise CheckpointError(f"cannot write checkpoint step {step} to {manager.directory}: {one_line(e)}") from None


def finish(manager: ocp.CheckpointManager | None) -> None:
  """Waits for background writes; their failure (e.g. a full disk) is one CheckpointError."""
  if manager is None:
    return
  try:
    manager.wait_until_finished()
  except Exception as e:
    raise CheckpointError(f"cannot write a checkpoint to {manager.directory}: {one_line(e)}") from None
  finally:
    manager.close()


def set_aside(manager: ocp.CheckpointManager, step: int) -> str:
  """Moves checkpoint `step` to <run>/checkpoints_unusable/<step> (kept for inspection, never resumed)."""
  manager.wait_until_finished()
  src = os.path.join(str(manager.directory), str(step))
  dst = os.path.join(os.path.dirname(str(manager.directory)), UNUSABLE_DIR, str(step))
  if os.path.exists(dst):
    shutil.rmtree(dst)
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  shutil.move(src, dst)
  manager.reload()
  return dst


def _shapes(tree) -> dict[str, tuple]:
  """{'a/0/b': shape}: keys as strings (the stored tree spells an int key 0 as '0')."""
  def name(path):
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  return {name(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _stored_tree(tree_dir: str) -> dict:
  """The stored tree's metadata (leaves carry shape and dtype; no array is read); an unreadable one raises."""
  return ocp.PyTreeCheckpointer().metadata(os.path.abspath(tree_dir)).item_metadata.tree


def _quantization(params: dict) -> str:
  """The weight_quantization a params tree was built with: fp8_block when it holds a block-quantized
  weight (a `<name>_scale` beside its `<name>`: a linear's kernel_scale, the experts' wi_0_scale), else none
  (a norm's `scale` has no such sibling)."""
  shapes = _shapes(params)
  return "fp8_block" if any(k.endswith("_scale") and k[:-len("_scale")] in shapes for k in shapes) else "none"


def _quantizations(stored: dict | None, target: dict) -> tuple[str, str]:
  """(the stored tree's weight_quantization, target's); both target's when the metadata was unreadable."""
  want = _quantization(target["params"])
  return (want if stored is None else _quantization(stored.get("params", {}))), want


def model_mismatch(tree_dir: str, target: dict) -> str | None:
  """How the params/buffers stored in tree_dir differ from target's (another model): the first path
  whose shapes differ, with both shapes; or None. Reads only the metadata; an unreadable one raises."""
  return _mismatch(_stored_tree(tree_dir), target)


def _mismatch(stored: dict, target: dict) -> str | None:
  """model_mismatch on a stored tree's metadata already read."""
  for part in ("params", "buffers"):
    have, want = _shapes(stored.get(part, {})), _shapes(target[part])
    for key in sorted(set(have) | set(want)):
      if have.get(key) != want.get(key):
        return (f"{part}/{key} is {have.get(key, 'absent')} in the checkpoint but {want.get(key, 'absent')} "
                "in this config")
  return None


def _check_restored(tree, meta: dict | None, key: str = "fingerprint") -> str | None:
  """Why a restored tree must not be used, or None: its state_check against meta[key] (no check when meta
  lacks it: checkpoints written before fingerprints, converter outputs) and every value finite."""
  fingerprint, finite = jax.device_get(settled(state_check(tree)))
  if meta is not None and key in meta and int(fingerprint) != meta[key]:
    return "its contents do not match the fingerprint saved with it (corrupt files)"
  if not finite:
    return "it holds non-finite values"
  return None


@read_scope.owned()  # a failed read's in-flight siblings end before the fallback goes on (issue 46)
def restore_newest_good(manager: ocp.CheckpointManager | None, abstract_state: dict, report=print):
  """(step, state, data_state) of the newest checkpoint that reads back intact, or None when there is
  none at all. A bad one is reported (one line), set aside, and the one before it tried; when every
  checkpoint is bad: CheckpointError. abstract_state carries the shardings (ShapeDtypeStruct leaves); its FROZEN
  entry is not read (the state comes back without it)."""
  abstract_state = checkpointed(abstract_state)
  if manager is None or manager.latest_step() is None:
    return None
  problems = []
  for step in sorted(manager.all_steps(), reverse=True):
    step_dir = os.path.join(str(manager.directory), str(step))
    try:
      stored = _stored_tree(os.path.join(step_dir, "state"))
    except Exception:  # unreadable metadata: the restore below says why
      stored = None
    have, want = _quantizations(stored, abstract_state)
    if have != want:
      raise ConfigError(f"checkpoint step {step} in {manager.directory} was written with weight_quantization={have} "
                        f"but this config has weight_quantization={want}: resume with weight_quantization={have}, "
                        "or choose another run_name")
    other = None if stored is None else _mismatch(stored, abstract_state)
    if other is not None:  # a whole other model: the checkpoints are fine, the config is not theirs
      raise CheckpointError(f"checkpoint step {step} in {manager.directory} is of another model: {other}; "
                            "choose another run_name (or run with the keys it was trained with)")
    items = dict(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
    if os.path.isdir(os.path.join(step_dir, "meta")):  # checkpoints written before fingerprints have none
      items["meta"] = ocp.args.JsonRestore()
    try:
      restored = manager.restore(step, args=ocp.args.Composite(**items))
      why = _check_restored(restored.state, restored.get("meta"))
    except Exception as e:  # truncated, missing or garbled files
      restored, why = None, f"it cannot be read ({one_line(e)})"
    if why is None:
      return step, restored.state, restored.data
    moved = set_aside(manager, step)
    problems.append(f"step {step}")
    report(f"checkpoint step {step} is unusable: {why}; moved to {moved}; trying the one before it")
  raise CheckpointError(f"no usable checkpoint in {manager.directory} (unusable: {', '.join(problems)}, set aside "
                        f"in {UNUSABLE_DIR}/); start afresh by running again, or choose another run_name")


def abstract_like(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


# ------------------------------------------------------------------------------ parameters only


def _is_tree(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "_METADATA"))


def _steps_in(path: str) -> list[int]:
  return sorted((int(n) for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n))),
                reverse=True)


def parameter_candidates(path: str) -> list[str]:
  """The tree folders `path` names, best first: one for a tree or a step, every step (newest first)
  for a `checkpoints` folder or a run folder."""
  key = f"load_parameters_path={path!r}"
  if not os.path.isdir(path):
    raise CheckpointError(f"{key}: no such checkpoint directory")
  if _is_tree(path):
    return [path]
  if _is_tree(os.path.join(path, "state")):
    return [os.path.join(path, "state")]
  folder = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
  steps = _steps_in(folder)
  if not steps:
    raise CheckpointError(f"{key} is not a checkpoint: give a converter output, a run's checkpoints folder, "
                          "one step folder (checkpoints/<step>) or its state subfolder")
  return [os.path.join(folder, str(s), "state") for s in steps]


def _step_meta(tree_dir: str) -> dict | None:
  """The meta JSON saved beside a run's step (<step>/meta/metadata next to <step>/state), or None (a converter
  output, or a step written before fingerprints)."""
  path = os.path.join(os.path.dirname(os.path.abspath(tree_dir)), "meta", "metadata")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


@read_scope.owned()  # as restore_newest_good
def restore_parameters(path: str, target: dict, report=print) -> tuple[str, dict]:
  """(the tree folder used, {"params", "buffers"}) restored onto target's shardings; only those two
  subtrees are read (a train state's optimizer and step are left on disk). Before reading any array:
  a checkpoint whose weight_quantization differs from target's is a ConfigError naming both values, one
  of another model a CheckpointError naming the first differing path and both shapes."""
  problems = []
  candidates = parameter_candidates(path)
  for tree_dir in candidates:
    try:
      stored = _stored_tree(tree_dir)  # the metadata, read once for both checks
    except Exception:  # unreadable metadata: the restore below says why
      stored = None
    have, want = _quantizations(stored, target)
    if have != want:
      raise ConfigError(f"weight_quantization={want} does not fit load_parameters_path={path!r}: it was converted "
                        f"with weight_quantization={have}; set weight_quantization={have} (or convert it again "
                        f"with weight_quantization={want})")
    other = None if stored is None else _mismatch(stored, target)
    if other is not None:
      raise CheckpointError(f"load_parameters_path={path!r} holds another model than this config: {other}; "
                            "give the model keys it was trained with (a converter output has them in model.yml)")
    try:
      restored = ocp.PyTreeCheckpointer().restore(
          os.path.abspath(tree_dir), args=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
      why = _check_restored(restored, _step_meta(tree_dir), "parameters_fingerprint")
    except Exception as e:
      why = f"it does not fit the configured model or cannot be read ({one_line(e)})"
    if why is None:
      return tree_dir, restored
    problems.append(f"{tree_dir}: {why}")
    if len(candidates) > 1:
      report(f"load_parameters_path: {tree_dir} is unusable: {why}; trying the one before it")
  raise CheckpointError(f"load_parameters_path={path!r}: no usable parameters ({'; '.join(problems)})")
