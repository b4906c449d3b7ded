"""AdamW with linear warmup + cosine decay and global-norm clipping (optax).

opt_moments_dtype=bfloat16 stores both Adam moments (mu, nu) in bf16: each step reads them to f32,
updates and bias-corrects in f32, computes the update in f32, and rounds only what it stores (optax's
own adamw has mu_dtype for mu alone). Per parameter: 4 bytes of optimizer state instead of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from MaxText.config.types import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """Linear 0 -> peak over warmup_steps, then cosine down to peak * final_fraction at `steps`."""
  peak = config.learning_rate
  warmup = min(config.warmup_steps, config.steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(config.steps, warmup + 1), end_value=peak * config.cosine_learning_rate_final_fraction)


def scale_by_adam_stored_as(b1: float, b2: float, eps: float, dtype) -> optax.GradientTransformation:
  """Adam's scaling (optax.scale_by_adam's math, its ScaleByAdamState) with mu and nu STORED in `dtype`:
  m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, update m_hat / (sqrt(v_hat) + eps), all in f32."""
  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731  [same shape as the parameter]
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                                  nu=jax.tree.map(zeros, params))

  def update(grads, state, params=None):
    del params
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    g = f32(grads)
    mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, f32(state.mu), g)
    nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, f32(state.nu), g)
    count = optax.safe_increment(state.count)
    c = count.astype(jnp.float32)
    mu_hat_scale, nu_hat_scale = 1 / (1 - b1 ** c), 1 / (1 - b2 ** c)
    updates = jax.tree.map(lambda m, v, x: (m * mu_hat_scale / (jnp.sqrt(v * nu_hat_scale) + eps)).astype(x.dtype),
                           mu, nu, grads)
    store = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)  # noqa: E731
    return updates, optax.ScaleByAdamState(count=count, mu=store(mu), nu=store(nu))

  return optax.GradientTransformation(init, update)


def adamw(config: Config) -> optax.GradientTransformation:
  """optax.adamw for f32 moments; the same chain (adam scaling, decoupled decay, -lr) with the
  moments stored in bf16 for opt_moments_dtype=bfloat16."""
  schedule = learning_rate_schedule(config)
  if config.opt_moments_dtype == "float32":
    return optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                       weight_decay=config.adam_weight_decay)
  return optax.chain(
      scale_by_adam_stored_as(config.adam_b1, config.adam_b2, config.adam_eps, jnp.dtype(config.opt_moments_dtype)),
      optax.add_decayed_weights(config.adam_weight_decay), optax.scale_by_learning_rate(schedule))


def state_memory_kind(config: Config) -> str | None:
  """Where the optimizer state lives between steps: "pinned_host" under optimizer_memory_host_offload (the
  train step moves it to the device for its update, on_device, and its out sharding moves the new state
  back), else None (the device, jax's default)."""
  return "pinned_host" if config.optimizer_memory_host_offload else None


def on_device(config: Config, opt_state):
  """opt_state where the update reads it: moved from host memory under optimizer_memory_host_offload."""
  return jax.device_put(opt_state, jax.memory.Space.Device) if config.optimizer_memory_host_offload else opt_state


def create_optimizer(config: Config, labels=None) -> optax.GradientTransformation:
  """labels: a pytree like the params of "train" / "freeze" (frozen: no update, no weight decay,
  and not counted by the clipping norm)."""
  chain = []
  if config.gradient_clipping_threshold > 0:
    chain.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
  chain.append(adamw(config))
  tx = optax.chain(*chain)
  if labels is None:
    return tx
  return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
