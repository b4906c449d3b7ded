"""Next-token sampling from logits [b,V]: greedy, temperature, nucleus (top-p). Pure, jit-able.

decode_sampling_strategy picks the method; decode_sampling_temperature divides the logits for
temperature and top_p; decode_sampling_nucleus_p is the nucleus mass. The key comes from
`seed` (the caller folds in the step), so a run is reproducible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, *, strategy: str, temperature: float = 1.0,
           nucleus_p: float = 1.0) -> jax.Array:
  """logits [b,V] fp32 -> token ids [b] int32."""
  if strategy == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits.astype(jnp.float32) / temperature  # [b,V]
  if strategy == "temperature":
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  if strategy == "top_p":
    return _nucleus(scaled, key, nucleus_p)
  raise ValueError(f"decode_sampling_strategy={strategy!r}: expected greedy, temperature or top_p")


def _nucleus(scaled: jax.Array, key: jax.Array, p: float) -> jax.Array:
  """Samples from the smallest set of most likely tokens whose probability mass reaches p."""
  order = jnp.argsort(-scaled, axis=-1)  # [b,V], most likely first
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
  keep = before < p  # the first token is always kept
  choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)  # [b]
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
