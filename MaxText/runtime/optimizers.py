"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import optax

from MaxText.config.types import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """Linear 0 -> peak over warmup_steps, then cosine down to peak * final_fraction at `steps`."""
  peak = config.learning_rate
  warmup = min(config.warmup_steps, config.steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(config.steps, warmup + 1), end_value=peak * config.cosine_learning_rate_final_fraction)


def create_optimizer(config: Config, labels=None) -> optax.GradientTransformation:
  """labels: a pytree like the params of "train" / "freeze" (frozen: no update, no weight decay,
  and not counted by the clipping norm)."""
  chain = []
  if config.gradient_clipping_threshold > 0:
    chain.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
  chain.append(optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                           eps=config.adam_eps, weight_decay=config.adam_weight_decay))
  tx = optax.chain(*chain)
  if labels is None:
    return tx
  return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
