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


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: jax.Array) -> jax.Array:
  """Each row by its own request's options: logits [B,V] fp32, keys [B] (one PRNG key per row),
  temperature [B] (0 = greedy), top_p [B] (1 = off), top_k [B] int (0 = off) -> ids [B] int32.

  A row's draw depends only on its logits, options and key (vmapped per row), so a request with
  a fixed seed gets the same tokens whatever else shares the batch."""
  def one(lg, key, temp, p, k):  # [V], key, [], [], []
    order = jnp.argsort(-lg)  # [V], most likely first
    sorted_lg = lg[order] / jnp.maximum(temp, 1e-6)
    rank = jnp.arange(lg.shape[0])
    probs = jax.nn.softmax(sorted_lg)
    before = jnp.cumsum(probs) - probs  # mass strictly ahead of each token
    keep = (before < p) & ((k <= 0) | (rank < k))  # the most likely token is always kept
    choice = jax.random.categorical(key, jnp.where(keep, sorted_lg, -jnp.inf))
    return jnp.where(temp > 0, order[choice], jnp.argmax(lg)).astype(jnp.int32)

  return jax.vmap(one)(logits.astype(jnp.float32), keys, temperature, top_p, top_k)
