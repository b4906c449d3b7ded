"""Tensorboard event files and the console progress line."""

from __future__ import annotations

import os
import sys
import time

from MaxText.config.types import Config


def fmt_duration(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def fmt_loss(v: float) -> str:
  """4 decimals, or scientific notation for small values (an indexer KL of 9e-05 is not 0.0000)."""
  return f"{v:.2e}" if v != 0 and abs(v) < 1e-2 else f"{v:.4f}"


class MetricsLogger:
  """Scalars to tensorboard every step; one console line every log_period steps. A resumed run
  purges the events past its checkpoint, so tensorboard shows each step once."""

  def __init__(self, config: Config, *, start_step: int = 0):
    self.config = config
    self.writer = None
    if config.enable_tensorboard:
      from tensorboardX import SummaryWriter
      os.makedirs(config.tensorboard_dir, exist_ok=True)
      self.writer = SummaryWriter(config.tensorboard_dir, purge_step=start_step + 1 if start_step else None)
    self.start_step = start_step
    self.t0 = None
    self.wall0 = time.time()
    self.last_eval: dict[str, float] = {}

  def log(self, step: int, scalars: dict[str, float], *, force_console: bool = False) -> None:
    if self.writer is not None:
      for k, v in scalars.items():
        self.writer.add_scalar(k, v, step)
    if self.t0 is None:  # the first step includes compilation: the ETA counts from after it
      self.t0, self.t0_step = time.time(), step
    if step % self.config.log_period == 0 or force_console or step == self.config.steps:
      done = step - self.t0_step
      rate = (time.time() - self.t0) / done if done > 0 else 0.0
      eta = fmt_duration(rate * (self.config.steps - step)) if done > 0 else "?"
      parts = [f"step {step}/{self.config.steps}"] + self._losses(scalars)
      parts += [f"{scalars['tokens_per_s']:,.0f} tok/s", f"lr {scalars['learning_rate']:.2e}", f"ETA {eta}"]
      print(" | ".join(parts), flush=True)

  def _losses(self, scalars: dict[str, float]) -> list[str]:
    parts = [f"loss {fmt_loss(scalars['loss'])}", f"lm {fmt_loss(scalars['lm_loss'])}"]
    if self.config.use_indexer and self.config.indexer_training_stage != "none":
      parts.append(f"indexer {fmt_loss(scalars['indexer_loss'])}")
    if self.config.mtp_num_layers:
      parts.append(f"mtp {fmt_loss(scalars['mtp_loss'])}")
    return parts

  def log_eval(self, step: int, scalars: dict[str, float]) -> None:
    """Eval metrics as eval_<name> in tensorboard, one console line."""
    self.last_eval = scalars
    if self.writer is not None:
      for k, v in scalars.items():
        self.writer.add_scalar(f"eval_{k}", v, step)
    print(f"eval step {step} | " + " | ".join(self._losses(scalars)) + f" | accuracy {scalars['accuracy']:.3f} "
          f"({self.config.eval_steps} batches)",
          flush=True)

  def summary(self, first: int, last: int, scalars: dict[str, float], weights: str) -> str:
    """The run's closing line: steps, tokens, time, final losses, where the weights are."""
    n = last - first + 1
    tokens = n * self.config.global_batch_size * self.config.max_target_length
    line = (f"done: steps {first}-{last} of {self.config.steps} ({tokens:,} tokens) in "
            f"{fmt_duration(time.time() - self.wall0)}; final " + " | ".join(self._losses(scalars)))
    if self.last_eval:
      line += f"; eval loss {fmt_loss(self.last_eval['loss'])}"
    return line + f"; weights: {weights}"

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


# Dense bf16 peak FLOP/s of one device, by a substring of jax's device_kind (lowercased); the first
# match wins ("TPU v5 lite" is a v5e, "TPU v5" a v5p, "TPU v6 lite" a v6e).
PEAK_FLOPS = (("v5 lite", 197e12), ("v5e", 197e12), ("v5p", 459e12), ("v5", 459e12), ("v4", 275e12),
              ("v6", 918e12), ("h100", 989e12), ("h200", 989e12), ("a100", 312e12))


# Bytes a second one device sends in a ring collective over one axis of its interconnect (both ring
# directions), by device_kind as PEAK_FLOPS: a v5p chip's ICI is 1200 GB/s bidirectional over 6 links (3D
# torus), 100 GB/s a link a direction, a ring along one torus axis drives 2 links out. Kinds without a
# documented per-link figure here are absent (no estimate).
RING_BYTES_PER_S = (("v5 lite", None), ("v5e", None), ("v5p", 200e9), ("v5", 200e9))


def ring_bytes_per_s(device_kind: str) -> float | None:
  """RING_BYTES_PER_S's entry for a device kind, None where it has none."""
  kind = device_kind.lower()
  return next((v for k, v in RING_BYTES_PER_S if k in kind), None)


def peak_flops(device_kind: str) -> float | None:
  """PEAK_FLOPS's entry for a device kind (jax.devices()[0].device_kind), None where it has none."""
  kind = device_kind.lower()
  return next((v for k, v in PEAK_FLOPS if k in kind), None)


def peak_flops_per_device() -> tuple[float, str]:
  """(peak FLOP/s of one device, where it comes from): the table for accelerators; elsewhere (the
  CPU) a measured fp32 matmul, so MFU there reads against what this machine really does."""
  import jax  # here only: the rest of this module needs no jax
  import jax.numpy as jnp

  kind = jax.devices()[0].device_kind
  peak = peak_flops(kind)
  if peak is not None:
    return peak, f"table ({kind})"
  a = jnp.ones((1024, 1024), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(5):
    f(a).block_until_ready()
  return 5 * 2 * 1024 ** 3 / (time.perf_counter() - t), f"no table entry for {kind!r}: a measured f32 matmul"


def warn(msg: str) -> None:
  print(f"warning: {msg}", file=sys.stderr, flush=True)
