"""Token embedding and rotary position embedding (plain RoPE and YaRN).

MLA rotates its rope dims as INTERLEAVED pairs (x0,x1),(x2,x3),...; the lightning indexer
rotates its first rope dims NON-interleaved (halves x[:d/2], x[d/2:]), after DeepSeek's
2025-11-17 fix. Both use the same frequencies. Dot products are what matter: a fixed
permutation of the rotated dims applied to both q and k changes nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config.types import Config
from MaxText.layers.linears import dtype_of
from MaxText.runtime.sharding import constrain


class Embed(nnx.Module):
  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(1.0)
    self.embedding = nnx.Param(init(rngs.params(), (config.vocab_size, config.emb_dim), dtype_of(config.weight_dtype)),
                               logical_axes=("vocab", "embed"))
    self.dtype = dtype_of(config.dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:  # [b,t] int -> [b,t,D]
    # The table is gathered over its embed shards (in the compute dtype) like any fsdp weight, so
    # the lookup stays on each device's own tokens. Looking up ALL tokens in an embed-sharded table
    # instead makes XLA all-gather the [b,t,D] result: 28 GiB per device for 8 x 128K tokens.
    table = constrain(self.embedding[...].astype(self.dtype), ("vocab", None))  # [V,D]
    return jnp.take(table, tokens, axis=0)  # [b,t,D]


def rope_inv_freq(config: Config, dim: int) -> np.ndarray:
  """Inverse frequencies [dim/2] (float32). YaRN blends interpolated (freq/factor) and
  extrapolated frequencies with a linear ramp between the beta_fast / beta_slow correction dims."""
  base = config.rope_max_timescale
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [dim/2]
  if config.rope_type == "yarn" and config.rope_factor > 1:
    orig = config.original_max_position_embeddings

    def correction_dim(rotations):
      return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    smooth = 1.0 - ramp  # 1 = keep the original (high) frequency, 0 = interpolate by factor
    freqs = freqs / config.rope_factor * (1 - smooth) + freqs * smooth
  return freqs.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """positions [b,t] -> cos, sin [b,t,dim/2] in float32."""
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [b,t,dim/2]
  return jnp.cos(ang), jnp.sin(ang)


def _bcast(c: jax.Array, x: jax.Array) -> jax.Array:
  """cos/sin [b,t,d/2] -> broadcastable against x [b,t,(heads...),d/2]."""
  return c.reshape(c.shape[:2] + (1,) * (x.ndim - 3) + c.shape[-1:])


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [b,t,...,d] with pairs (x[2i], x[2i+1]) rotated by angle i; output keeps the pair layout."""
  xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))  # [b,t,...,d/2,2]
  x1, x2 = xf[..., 0], xf[..., 1]
  c, s = _bcast(cos, x1), _bcast(sin, x1)
  out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # [b,t,...,d/2,2]
  return out.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [b,t,...,d] with halves (x[:d/2], x[d/2:]) rotated (rotate_half, non-interleaved)."""
  xf = x.astype(jnp.float32)
  h = x.shape[-1] // 2
  x1, x2 = xf[..., :h], xf[..., h:]
  c, s = _bcast(cos, x1), _bcast(sin, x1)
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
