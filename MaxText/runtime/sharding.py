"""Device mesh and logical-axis sharding.

Layers name logical axes (parameters carry `logical_axes` metadata; activations go through
`constrain`); `logical_axis_rules` in base.yml map each logical name onto mesh axes. The mesh
layout (which axis is how big) is kept apart from the layer code.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config.types import Config

_ACTIVE_RULES: list[tuple[Mesh, dict]] = []


def create_mesh(config: Config, devices=None) -> Mesh:
  """A mesh with config.mesh_axes, sized by the (resolved) ici_*_parallelism keys."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [config.mesh_shape[a] for a in config.mesh_axes]
  need = math.prod(shape)
  if need > len(devices):
    raise ValueError(f"the mesh {dict(zip(config.mesh_axes, shape))} needs {need} devices, {len(devices)} exist")
  return Mesh(np.array(devices[:need]).reshape(shape), tuple(config.mesh_axes))


def rules_of(config: Config) -> dict[str, tuple[str, ...]]:
  return {name: tuple(axes) for name, axes in config.logical_axis_rules}


def logical_to_spec(logical_axes, rules: dict, mesh: Mesh, shape=None) -> PartitionSpec:
  """Maps logical names to a PartitionSpec; a mesh axis is used at most once, size-1 axes and
  axes that do not divide the dimension are dropped (replicated) rather than failing."""
  used, spec = set(), []
  for i, name in enumerate(logical_axes):
    axes = [a for a in rules.get(name, ()) if a not in used and mesh.shape.get(a, 1) > 1] if name else []
    if shape is not None:
      kept = []
      for a in axes:
        if shape[i] % (math.prod(mesh.shape[x] for x in kept) * mesh.shape[a]) == 0:
          kept.append(a)
      axes = kept
    used.update(axes)
    spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
  return PartitionSpec(*spec)


def param_logical_axes(var: nnx.Variable) -> tuple:
  """A variable's logical axes; stacked (scanned) layers get a leading "layers" axis."""
  axes = tuple(var.get_metadata().get("logical_axes", ()))
  value = var.get_value() if hasattr(var, "get_value") else var.value
  ndim = len(value.shape)
  if len(axes) < ndim:
    axes = ("layers",) * (ndim - len(axes)) + axes
  return axes


def state_shardings(state, config: Config, mesh: Mesh):
  """NamedShardings for an nnx.State (parameters or optimizer state built from them)."""
  rules = rules_of(config)

  def one(var):
    if isinstance(var, nnx.Variable):
      value = var.get_value() if hasattr(var, "get_value") else var.value
      spec = logical_to_spec(param_logical_axes(var), rules, mesh, value.shape)
      return var.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@contextlib.contextmanager
def _in_force(mesh: Mesh, rules: dict):
  """(mesh, rules) the innermost in force for this context."""
  _ACTIVE_RULES.append((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE_RULES.pop()


def logical_rules(config: Config, mesh: Mesh):
  """Activations constrained with `constrain` inside this context follow the config's rules."""
  return _in_force(mesh, rules_of(config))


def stage_local():
  """Inside the pipeline (layers/pipeline.py) `stage` is the stages' own axis: every logical name but
  activation_stage loses it (outside, the stages split the batch too: activation_batch's rule), so a microbatch's
  rows split over the other batch axes alone and the stage vmap (spmd_axis_name="stage") adds the stage itself."""
  if not _ACTIVE_RULES:
    return contextlib.nullcontext()
  mesh, rules = _ACTIVE_RULES[-1]
  return _in_force(mesh, {k: v if k == "activation_stage" else tuple(a for a in v if a != "stage")
                          for k, v in rules.items()})


def active_mesh() -> tuple[Mesh, dict] | None:
  """(mesh, rules) of the innermost `logical_rules` context, or None outside any."""
  return _ACTIVE_RULES[-1] if _ACTIVE_RULES else None


def kernel_mesh() -> tuple[Mesh, dict] | None:
  """(mesh, rules) where a Pallas (Mosaic) kernel must wrap itself in a jax.shard_map (XLA does not partition
  Mosaic kernels): under logical_rules on several devices and not already inside a shard_map (the serving
  engine's per-shard reads). None: call the kernel on the arrays as they are."""
  active = active_mesh()
  if active is None or active[0].size == 1 or jax.sharding.get_abstract_mesh().manual_axes:
    return None
  return active


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op outside `logical_rules`."""
  if not _ACTIVE_RULES:
    return x
  mesh, rules = _ACTIVE_RULES[-1]
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, x.shape)))


def load_balance_permutation(t: int, cp: int) -> np.ndarray:
  """Zig-zag order for causal context parallelism: the sequence in 2*cp chunks, device i holds
  chunks i and 2*cp-1-i, so every device gets the same causal work. new[j] = old[perm[j]]."""
  if t % (2 * cp):
    raise ValueError(f"sequence length {t} is not divisible by 2 x ici_context_parallelism = {2 * cp}")
  chunks = np.arange(t).reshape(2 * cp, t // (2 * cp))
  order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
  return chunks[order].reshape(-1)


def gather_sequence(x: jax.Array, config: Config, *, names: tuple) -> jax.Array:
  """Keys for context-parallel attention: replicate along the sequence (every device needs every
  key: an all-gather of the small MLA latent) and, under load balancing, undo the zig-zag so the
  key axis is in ORIGINAL order: tie-breaking "lowest position first" then means what it says.
  x [b,s,...]; names: its logical axes with the sequence axis (1) given as None."""
  x = constrain(x, names)
  cp = config.ici_context_parallelism
  if cp > 1 and config.context_parallel_load_balance:
    inverse = np.argsort(load_balance_permutation(x.shape[1], cp))
    x = jnp.take(x, jnp.asarray(inverse), axis=1)  # [b,s,...] original order
    x = constrain(x, names)
  return x
