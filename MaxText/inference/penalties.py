"""A request's logits adjustments before the kept set, in vLLM's order and by its definitions
(vllm/v1/sample/sampler.py, ops/penalties.py, logits_processor/builtin.py):

  1. logit_bias: logits[id] += bias (OpenAI's, in [-100, 100]); min_tokens: while the output has
     fewer than min_tokens tokens, EOS (unless ignore_eos) and every stop_token_ids id at -inf (not a
     single-token stop string's id, stop_string_ids: vLLM bans only EOS and stop_token_ids, and merely
     looks for stop strings from then on, scheduler.py);
  2. repetition_penalty r (vLLM's, 1 = off) over every id in the prompt or the output so far:
     logit / r where logit > 0, logit * r otherwise;
  3. frequency_penalty f and presence_penalty p (OpenAI's, in [-2, 2]) over the output so far:
     logit -= f * count(id) + p * (count(id) > 0);
  4. then, after temperature, min_p m (0 = off): ids whose probability is below m times the most
     likely one's are dropped (a sampling row's; greedy keeps its argmax anyway); then top_k/top_p.

Stages 1-3 change greedy rows too. They need each row's history, which lives on the host: per step,
`step_arrays` sends only the ids a row touches, ids [B,S] int32 (V past a row's entries: dropped) and
their values [B,S,3] fp32 (bias, repetition factor, subtracted penalty), S the smallest power of two
>= 8 holding the step's fullest row; `apply` gathers, adjusts and scatters those [B,S] logits. A row
that adjusts can have no entries in a step (penalties alone before its first token; min_tokens alone
once reached): it is left as padding. A step whose rows have no entries sends None and runs the step program without this stage; any request's
values are data, so only S (a handful of powers of two) picks a program, never a request's numbers.
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_MIN_WIDTH = 8


def adjusts(params) -> bool:
  """Whether a request's SamplingParams change its logits before the kept set (stages 1-3)."""
  return bool(params.logit_bias or params.min_tokens or params.repetition_penalty != 1.0
              or params.frequency_penalty or params.presence_penalty)


def row_entries(params, prompt: Sequence[int], output: Sequence[int], eos_id: int | None) -> dict[int, list]:
  """One row's adjusted ids -> [bias, repetition factor, subtracted penalty] (host side, stages 1-3)."""
  out: dict[int, list] = collections.defaultdict(lambda: [0.0, 1.0, 0.0])
  for tok, bias in params.logit_bias:
    out[tok][0] += bias
  if len(output) < params.min_tokens:
    stops = set(params.stop_token_ids) - set(params.stop_string_ids)
    stops |= set() if params.ignore_eos or eos_id is None else {eos_id}
    for tok in stops:
      out[tok][0] = -np.inf
  if params.repetition_penalty != 1.0:
    for tok in set(prompt) | set(output):
      out[tok][1] = params.repetition_penalty
  if params.frequency_penalty or params.presence_penalty:
    for tok, n in collections.Counter(output).items():
      out[tok][2] = params.frequency_penalty * n + params.presence_penalty
  return out


def step_arrays(rows: Sequence, where: Sequence[int], b: int, vocab: int, eos_id: int | None):
  """The step's (ids [b,S] int32, values [b,S,3] fp32) for its sampling rows that adjust, or None when
  none has an entry this step."""
  per = {i: entries for i, row in zip(where, rows) if row.samples and adjusts(row.request.params)
         if (entries := row_entries(row.request.params, row.request.prompt, row.request.output, eos_id))}
  if not per:
    return None
  s = max(_MIN_WIDTH, 1 << (max(len(e) for e in per.values()) - 1).bit_length())
  ids = np.full((b, s), vocab, np.int32)  # V: out of range, the scatter drops it
  vals = np.zeros((b, s, 3), np.float32)
  vals[..., 1] = 1.0
  for i, entries in per.items():
    ids[i, :len(entries)] = list(entries)
    vals[i, :len(entries)] = list(entries.values())
  return jnp.asarray(ids), jnp.asarray(vals)


def apply(logits: jax.Array, ids: jax.Array, vals: jax.Array) -> jax.Array:
  """Stages 1-3: logits [B,V] fp32, ids [B,S] (distinct per row; V = none), vals [B,S,3] -> logits [B,V]."""
  v = logits.shape[-1]
  got = jnp.take_along_axis(logits, jnp.minimum(ids, v - 1), axis=-1) + vals[..., 0]  # [B,S] biased
  rep = vals[..., 1]
  new = jnp.where(got > 0, got / rep, got * rep) - vals[..., 2]  # [B,S]
  rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], ids.shape)  # [B,S]
  return logits.at[rows, ids].set(new, mode="drop")


def min_p_filter(logits: jax.Array, temperature: jax.Array, min_p: jax.Array) -> jax.Array:
  """Stage 4: logits [B,V] fp32, temperature [B], min_p [B] (0 = off) -> logits [B,V], -inf where
  softmax(logits / T) < min_p * its max, i.e. (logit - max) / T < log(min_p): no softmax needed. A
  greedy row (T 0) is unchanged (its argmax always passes). Skipped when no sampling row sets min_p."""
  on = (min_p > 0) & (temperature > 0)  # [B]

  def cut():
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B,1]
    t = jnp.maximum(temperature, 1e-6)[:, None]  # [B,1]
    keep = (logits - top) / t >= jnp.log(jnp.maximum(min_p, 1e-30))[:, None]  # [B,V]
    return jnp.where(on[:, None] & ~keep, -jnp.inf, logits)

  return jax.lax.cond(jnp.any(on), cut, lambda: logits)


__all__ = ["adjusts", "row_entries", "step_arrays", "apply", "min_p_filter"]
