"""Linear layers with logical-axis annotations, and the SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.types import Config

PRECISION = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
             "highest": jax.lax.Precision.HIGHEST}


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def param(rngs: nnx.Rngs, shape, axes: tuple[str, ...], config: Config, *, init=None) -> nnx.Param:
  """A parameter holding its logical axes (sharding.py maps them onto the mesh)."""
  assert len(shape) == len(axes), (shape, axes)
  init = init or jax.nn.initializers.normal(config.param_init_std)
  return nnx.Param(init(rngs.params(), shape, dtype_of(config.weight_dtype)), logical_axes=tuple(axes))


class Linear(nnx.Module):
  """y = x @ kernel, kernel [in, out]; computes in config.dtype at config.matmul_precision."""

  def __init__(self, in_features: int, out_features: int, config: Config, *, axes: tuple[str, str],
               rngs: nnx.Rngs, dtype=None):
    self.kernel = param(rngs, (in_features, out_features), axes, config)
    self.dtype = dtype or dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]

  def __call__(self, x: jax.Array) -> jax.Array:
    k = self.kernel[...].astype(self.dtype)
    return jnp.einsum("...i,io->...o", x.astype(self.dtype), k, precision=self.precision)  # [..., out]


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), the dense layers' and the shared experts' MLP."""

  def __init__(self, config: Config, hidden: int, *, rngs: nnx.Rngs):
    d = config.emb_dim
    self.gate = Linear(d, hidden, config, axes=("embed", "mlp"), rngs=rngs)
    self.up = Linear(d, hidden, config, axes=("embed", "mlp"), rngs=rngs)
    self.down = Linear(hidden, d, config, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:  # [b,t,D] -> [b,t,D]
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
