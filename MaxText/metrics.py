"""Tensorboard event files and the console progress line."""

from __future__ import annotations

import os
import sys
import time

from MaxText.types import Config


def _fmt_duration(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class MetricsLogger:
  """Scalars to tensorboard every step; one console line every log_period steps."""

  def __init__(self, config: Config, *, start_step: int = 0):
    self.config = config
    self.writer = None
    if config.enable_tensorboard:
      from tensorboardX import SummaryWriter
      os.makedirs(config.tensorboard_dir, exist_ok=True)
      self.writer = SummaryWriter(config.tensorboard_dir)
    self.start_step = start_step
    self.t0 = None

  def log(self, step: int, scalars: dict[str, float], *, force_console: bool = False) -> None:
    if self.writer is not None:
      for k, v in scalars.items():
        self.writer.add_scalar(k, v, step)
    if self.t0 is None:  # the first step includes compilation: the ETA counts from after it
      self.t0, self.t0_step = time.time(), step
    if step % self.config.log_period == 0 or force_console or step == self.config.steps:
      done = step - self.t0_step
      rate = (time.time() - self.t0) / done if done > 0 else 0.0
      eta = _fmt_duration(rate * (self.config.steps - step)) if done > 0 else "?"
      parts = [f"step {step}/{self.config.steps}", f"loss {scalars['loss']:.4f}", f"lm {scalars['lm_loss']:.4f}"]
      if self.config.use_indexer and self.config.indexer_training_stage != "none":
        parts.append(f"indexer {scalars['indexer_loss']:.4f}")
      if self.config.mtp_num_layers:
        parts.append(f"mtp {scalars['mtp_loss']:.4f}")
      parts += [f"{scalars['tokens_per_s']:,.0f} tok/s", f"lr {scalars['learning_rate']:.2e}", f"ETA {eta}"]
      print(" | ".join(parts), flush=True)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.flush()
      self.writer.close()


def model_flops_per_token(config: Config, active_params: int) -> float:
  """Training FLOPs per token: 6 x active matmul params + attention over the selected keys."""
  t = config.max_target_length
  keys = min(config.indexer_topk, t) if config.use_indexer else t / 2
  attn = 12 * config.num_decoder_layers * keys * config.num_query_heads * (config.qk_head_dim + config.v_head_dim) / 2
  return 6.0 * active_params + attn


def warn(msg: str) -> None:
  print(f"warning: {msg}", file=sys.stderr, flush=True)
