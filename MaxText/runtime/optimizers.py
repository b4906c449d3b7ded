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


def scale_by_adam_stored_as(b1: float, b2: float, eps: float, dtype, stream: bool = False
                            ) -> optax.GradientTransformation:
  """Adam's scaling (optax.scale_by_adam's math, its ScaleByAdamState) with mu and nu STORED in `dtype`:
  m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, update m_hat / (sqrt(v_hat) + eps), all in f32.

  stream=True (optimizer_memory_host_offload): mu and nu arrive in host memory and leave there, one parameter
  at a time: parameter i's moments move to the device only once parameter i-1's new moments are back in host
  memory (an optimization barrier joins them), so the device holds one parameter's moments at a time, not
  the whole state (moved at once, the TPU compiler's peak grew by about the state's size)."""
  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731  [same shape as the parameter]
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                                  nu=jax.tree.map(zeros, params))

  def update(grads, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    c = count.astype(jnp.float32)
    mu_hat_scale, nu_hat_scale = 1 / (1 - b1 ** c), 1 / (1 - b2 ** c)

    def one(g, m, v):
      """One parameter: its gradient and stored moments -> (its update, new stored mu, new stored nu)."""
      g32 = g.astype(jnp.float32)
      m = b1 * m.astype(jnp.float32) + (1 - b1) * g32
      v = b2 * v.astype(jnp.float32) + (1 - b2) * g32 * g32
      u = (m * mu_hat_scale / (jnp.sqrt(v * nu_hat_scale) + eps)).astype(g.dtype)
      return u, m.astype(dtype), v.astype(dtype)

    gs, treedef = jax.tree.flatten(grads)
    ms, vs = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    out, stored = [], ()
    for g, m, v in zip(gs, ms, vs):
      if stream:  # this parameter's moments leave host memory after the previous parameter's are stored back
        m, v, _ = jax.lax.optimization_barrier((m, v, stored))
        m, v = jax.device_put((m, v), jax.memory.Space.Device)
      u, m, v = one(g, m, v)
      if stream:
        m, v = stored = jax.device_put((m, v), jax.memory.Space.Host)
      out.append((u, m, v))
    updates, mu, nu = (treedef.unflatten(list(t)) for t in zip(*out)) if out else (grads, state.mu, state.nu)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def adamw(config: Config) -> optax.GradientTransformation:
  """optax.adamw for f32 moments on the device; the same chain (adam scaling, decoupled decay, -lr) with the
  moments stored in bf16 for opt_moments_dtype=bfloat16, or streamed from host memory a parameter at a time
  under optimizer_memory_host_offload (the same state tree either way: checkpoints move between them)."""
  schedule = learning_rate_schedule(config)
  if config.opt_moments_dtype == "float32" and not config.optimizer_memory_host_offload:
    return optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                       weight_decay=config.adam_weight_decay)
  return optax.chain(
      scale_by_adam_stored_as(config.adam_b1, config.adam_b2, config.adam_eps, jnp.dtype(config.opt_moments_dtype),
                              stream=config.optimizer_memory_host_offload),
      optax.add_decayed_weights(config.adam_weight_decay), optax.scale_by_learning_rate(schedule))


def state_memory_kind(config: Config) -> str | None:
  """Where the optimizer state lives between steps: "pinned_host" under optimizer_memory_host_offload (the
  train step moves Adam's moments to the device a parameter at a time, scale_by_adam_stored_as(stream=True),
  and the rest at once, on_device; its out sharding keeps the new state there), else None (the device)."""
  return "pinned_host" if config.optimizer_memory_host_offload else None


def streamed(path) -> bool:
  """Whether an optimizer-state leaf (its key path) is one of Adam's moments, which the update streams."""
  return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in ("mu", "nu") for k in path)


def on_device(config: Config, opt_state):
  """opt_state where the update reads it: under optimizer_memory_host_offload the leaves other than Adam's
  moments (step counts) moved from host memory; the moments stay there for the update to stream."""
  if not config.optimizer_memory_host_offload:
    return opt_state
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if streamed(path) else jax.device_put(x, jax.memory.Space.Device), opt_state)


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
