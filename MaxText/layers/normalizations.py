"""RMSNorm (model and MLA latents) and LayerNorm with bias (the indexer's key norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.types import Config
from MaxText.layers.linears import dtype_of


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x^2) + eps) * scale, computed in fp32."""

  def __init__(self, dim: int, config: Config, *, eps: float | None = None):
    self.scale = nnx.Param(jnp.ones((dim,), dtype_of(config.weight_dtype)), logical_axes=("norm",))
    self.eps = config.normalization_layer_epsilon if eps is None else eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
  """(x - mean) / sqrt(var + eps) * scale + bias, computed in fp32."""

  def __init__(self, dim: int, config: Config, *, eps: float = 1e-6):
    wd = dtype_of(config.weight_dtype)
    self.scale = nnx.Param(jnp.ones((dim,), wd), logical_axes=("norm",))
    self.bias = nnx.Param(jnp.zeros((dim,), wd), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
