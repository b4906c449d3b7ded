"""Penalties a step: the whole-history rebuild (penalties.from_scratch) against the engine's incremental
path (penalties.History + the device State), side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/penalties.py [--rows 16] [--prompt 32768] [--steps 20]

--rows requests of --prompt random ids with every penalty and a logit_bias. Prints per path the median host ms,
bytes sent (step_channel's message) and ms to the adjusted logits (the incremental path's first step apart),
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference import penalties, step_channel
from MaxText.inference.scheduler import Request, SamplingParams


def _scratch_step(rows, b, vocab, logits):
  """The former path: every entry rebuilt -> (host s, bytes sent, adjusted logits)."""
  t = time.perf_counter()
  arrays = penalties.from_scratch(rows, range(b), b, vocab, None)
  host = time.perf_counter() - t
  out = _apply_entries(logits, *(jnp.asarray(a) for a in arrays))
  return host, len(step_channel.encode("step", (arrays,))), out


def _incremental_step(history, state, rows, b, vocab, logits):
  """The engine's path -> (host s, bytes sent, adjusted logits, the State)."""
  t = time.perf_counter()
  adjust = history.step_arrays(rows, range(b), b, vocab, None, [row.request for row in rows])
  host = time.perf_counter() - t
  state, inputs = penalties.device_inputs(state, adjust, b, vocab)
  got = _apply(logits[:, None], *inputs)[:, 0]  # [b,V]: one position a row
  return host, len(step_channel.encode("step", (adjust,))), got, state


_apply_entries = jax.jit(penalties.apply_entries)
_apply = jax.jit(penalties.apply)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--prompt", type=int, default=32768)
  ap.add_argument("--steps", type=int, default=20)
  args = ap.parse_args()
  b, v = args.rows, 129280  # DeepSeek-V3.2's vocabulary
  rng = np.random.default_rng(0)
  params = SamplingParams(max_tokens=1 << 20, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4,
                          logit_bias=((11, 3.0),))
  rows = [types.SimpleNamespace(request=Request(rng.integers(0, v, args.prompt).tolist(), params), samples=True)
          for _ in range(b)]
  for row in rows:
    row.request.output.append(int(rng.integers(0, v)))
  logits = jax.device_put(rng.normal(size=(b, v)).astype(np.float32))
  history, state = penalties.History(b), penalties.init_state(b, v)
  scratch, incremental = [], []
  for step in range(args.steps + 2):  # step 0: the incremental path sends the prompts; step 1: compiles settle
    t = time.perf_counter()
    host, sent, want = _scratch_step(rows, b, v, logits)
    want.block_until_ready()
    scratch.append((host, sent, time.perf_counter() - t))
    t = time.perf_counter()
    host, sent, got, state = _incremental_step(history, state, rows, b, v, logits)
    got.block_until_ready()
    incremental.append((host, sent, time.perf_counter() - t))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)  # the same logits
    for row in rows:
      row.request.output.append(int(rng.integers(0, v)))
  med = lambda runs, k: statistics.median(r[k] for r in runs[2:])  # noqa: E731
  result = {"rows": b, "prompt": args.prompt, "vocab": v, "steps": args.steps, "device": jax.devices()[0].device_kind,
            "scratch_host_ms": med(scratch, 0) * 1e3, "scratch_bytes": int(med(scratch, 1)),
            "scratch_step_ms": med(scratch, 2) * 1e3, "incremental_host_ms": med(incremental, 0) * 1e3,
            "incremental_bytes": int(med(incremental, 1)), "incremental_step_ms": med(incremental, 2) * 1e3,
            "incremental_first_host_ms": incremental[0][0] * 1e3, "incremental_first_bytes": incremental[0][1]}
  result = {k: round(x, 3) if isinstance(x, float) else x for k, x in result.items()}
  print(f"{b} rows x {args.prompt} prompt tokens, V {v}, {result['device']} (median of {args.steps} decode steps)")
  print(f"{'path':<34}{'host ms':>10}{'bytes sent':>14}{'step ms':>10}")
  for name, key in (("from_scratch (former)", "scratch"), ("incremental (History + State)", "incremental")):
    print(f"{name:<34}{result[key + '_host_ms']:>10.3f}{result[key + '_bytes']:>14,}{result[key + '_step_ms']:>10.3f}")
  print(f"{'incremental, its first step':<34}{result['incremental_first_host_ms']:>10.3f}"
        f"{result['incremental_first_bytes']:>14,}")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
