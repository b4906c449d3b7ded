"""The indexer KL target alone: kernels/kl_target.py's Pallas kernel against the XLA head_summed_probs, side by side.

    python benchmarks/kl_target.py                      # b 1, t 2048, h 128, d 192 bf16 (deepseek3.2-v5e's layer)
    python benchmarks/kl_target.py --batch 2 --iters 9
    python benchmarks/kl_target.py --heads 4 --tokens 256 --iters 2   # a CPU smoke run (the kernel interpreted)

Inputs: random bf16 q, k [b,t,h,d], two packed segments a row (the second from t/2 + 64). Each way compiled
once, checked against the other (max abs difference; values in [0, h]), then timed: median of --iters calls
each, the two ways called in turn (decode.time_variants). Prints a table and one JSON line. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench  # noqa: E402  (benchmarks/decode.py: time_variants)

from MaxText.kernels.flash_attention import head_summed_probs  # noqa: E402
from MaxText.kernels.kl_target import head_summed_probs_kernel  # noqa: E402
from MaxText.kernels.masks import attention_validity


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--tokens", type=int, default=2048)
  ap.add_argument("--heads", type=int, default=128)
  ap.add_argument("--dim", type=int, default=192)
  ap.add_argument("--iters", type=int, default=7)
  args = ap.parse_args(argv)
  b, t, h, d = args.batch, args.tokens, args.heads, args.dim
  if t % 128 or t < 256:
    ap.error(f"--tokens {t}: a multiple of 128, at least 256 (two segments)")
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(2))
  cut = t // 2 + 64
  seg = jnp.asarray(np.where(np.arange(t) < cut, 1, 2)[None].repeat(b, 0), jnp.int32)  # [b,t]
  pos = jnp.asarray(np.concatenate([np.arange(cut), np.arange(t - cut)])[None].repeat(b, 0), jnp.int32)
  valid = attention_validity(pos, pos, seg, seg)  # [b,t,t]
  scale = d ** -0.5
  xla = jax.jit(lambda q, k, valid: head_summed_probs(q, k, valid, scale))
  kernel = jax.jit(lambda q, k, seg: head_summed_probs_kernel(q, k, seg, scale))
  diff = float(jnp.max(jnp.abs(xla(q, k, valid) - kernel(q, k, seg))))
  times, _ = bench.time_variants({"xla": lambda: xla(q, k, valid), "kernel": lambda: kernel(q, k, seg)}, args.iters)
  ms = {way: statistics.median(v) * 1e3 for way, v in times.items()}
  print(f"KL target, b {b}, t {t}, h {h}, d {d} bf16 on {jax.devices()[0].device_kind}: max |kernel - xla| {diff:.2e}")
  print(f"{'way':8} {'ms (median of ' + str(args.iters) + ')':>22}")
  for way, v in ms.items():
    print(f"{way:8} {v:22.3f}")
  print(json.dumps(dict(benchmark="kl_target", batch=b, tokens=t, heads=h, dim=d, device=jax.devices()[0].device_kind,
                        max_abs_diff=diff, xla_ms=ms["xla"], kernel_ms=ms["kernel"],
                        speedup=ms["xla"] / ms["kernel"])))


if __name__ == "__main__":
  main()
