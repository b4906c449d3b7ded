"""Orbax checkpoints of the whole train state (params, buffers, optimizer, step) and the data position."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from MaxText.types import Config


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.max_checkpoints_to_keep, enable_async_checkpointing=config.async_checkpointing,
      create=True)
  return ocp.CheckpointManager(os.path.abspath(config.checkpoint_dir), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: dict, data_state: dict) -> None:
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             data=ocp.args.JsonSave(data_state)), force=True)


def restore_latest(manager: ocp.CheckpointManager | None, abstract_state: dict):
  """(step, state, data_state) of the newest checkpoint, or None. abstract_state carries the
  shardings (jax.ShapeDtypeStruct leaves) the restored arrays are placed with."""
  if manager is None or manager.latest_step() is None:
    return None
  step = manager.latest_step()
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                           data=ocp.args.JsonRestore()))
  return step, restored.state, restored.data


def abstract_like(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
