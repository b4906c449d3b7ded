"""Logprobs in the serving engine: the model's log-softmax at the positions a request asks for.

A request asks with SamplingParams.logprobs = N (each generated token's logprob and the top N) and/or
prompt_logprobs = N (every prompt token's logprob from position 1, and the top N at each). They are the
model's log-softmax over its logits BEFORE temperature, top_p and top_k (vLLM's default): the
distribution the model gives, not the one the request draws from: over the whole vocabulary, also
with sample_vocab (a tokenizer smaller than vocab_size: sampling never draws past it, yet the logprobs
stay the training model's log-softmax; a trained model gives those ids next to no mass), and also with
a grammar (structured outputs, grammar.py): its bitmask changes what is drawn, never the logprobs reported.

On the device (`step_logprobs`, inside the engine's logprob step): only a step that holds a row asking
for logprobs runs that program; it computes the logits at every row position [B,t,V] (the plain step
keeps only each row's last), their log-softmax, and returns [B,t] the logprob of each position's next
token (the prompt's next token, or at the row's sampling position the token just drawn) with the top N
[B,t,N] values and ids: N = serve_max_logprobs, fixed, so a step returns [B,t,N+1] values (and the
token's rank), never the vocabulary. A step without such a row runs the plain program: nothing more leaves the device.

On the host (`record`): Request.logprobs[p] = Logprob(logprob of token p, its rank, the top N
[(id, logprob)] of its position) for every position p a row computed: p < len(prompt) when prompt_logprobs is asked, the
sampled token's position when logprobs is. A row recomputed after a preemption writes the same
positions again. Prompt logprobs need every prompt position's logits: a request asking for them does
not take cached prefix pages (scheduler.py `_share_prefix`): its whole prompt is recomputed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Logprob(NamedTuple):
  """One position's: the token's logprob, its rank (1 = the most likely), the top N [(id, logprob)]."""
  logprob: float
  rank: int
  top: list


def step_logprobs(logits: jax.Array, nxt: jax.Array, n: int) -> tuple[jax.Array, ...]:
  """logits [B,t,V], nxt [B,t] (each position's next token) -> (its logprob [B,t] fp32, its rank [B,t]
  int32 (1 + the ids more likely), the top n logprobs [B,t,n] fp32, largest first, their ids [B,t,n] int32)."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B,t,V]
  tok = jnp.take_along_axis(lp, nxt[..., None], axis=-1)[..., 0]  # [B,t]
  rank = 1 + jnp.sum(lp > tok[..., None], axis=-1, dtype=jnp.int32)  # [B,t]
  vals, ids = jax.lax.top_k(lp, min(n, lp.shape[-1]))  # [B,t,n]
  return tok, rank, vals, ids.astype(jnp.int32)


def next_tokens(f: dict, sampled: jax.Array) -> jax.Array:
  """A step_feed's next token at each row position [B,t]: f["next"], with the token just drawn [B] at a
  sampling row's last known position."""
  at_last = (jnp.arange(f["next"].shape[1])[None] == f["last"][:, None]) & f["samples"][:, None]  # [B,t]
  return jnp.where(at_last, sampled[:, None], f["next"])


def wants(rows: Sequence) -> bool:
  """Whether any of a step's rows asks for logprobs (the step then runs the logprob program)."""
  return any(row.request.params.logprobs is not None or row.request.params.prompt_logprobs is not None
             for row in rows)


def record(rows: Sequence, where: Sequence[int], tok: np.ndarray, rank: np.ndarray, vals: np.ndarray,
           ids: np.ndarray) -> None:
  """Stores each asking row's logprobs in its Request (call before scheduler.update: positions are read
  from the row as scheduled). tok, rank [B,t], vals/ids [B,t,N] on the host; where: each row's batch row."""
  for row, i in zip(rows, where):
    r, p = row.request, row.request.params
    if p.logprobs is None and p.prompt_logprobs is None:
      continue
    for j in range(row.known):
      pos = row.start + j + 1  # the token row position j predicts
      n = p.prompt_logprobs if pos < len(r.prompt) else p.logprobs
      if n is None or pos > len(r.tokens):
        continue
      r.logprobs[pos] = Logprob(float(tok[i, j]), int(rank[i, j]),
                                [(int(ids[i, j, m]), float(vals[i, j, m])) for m in range(n)])


def check(logprobs: int | None, prompt_logprobs: int | None, most: int, speculative: int) -> None:
  """Raises RequestError naming the field: N in [0, serve_max_logprobs]; none while speculating."""
  from MaxText.inference.scheduler import RequestError
  for field, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
    if n is None:
      continue
    if not 0 <= n <= most:
      raise RequestError(f"{field}={n} is invalid: expected an integer in [0, {most}] (serve_max_logprobs)", field)
    if speculative:
      raise RequestError(f"{field} is not served with speculative decoding (serve_speculative_tokens="
                         f"{speculative}): restart the server with serve_speculative_tokens=0", field)


__all__ = ["Logprob", "step_logprobs", "next_tokens", "wants", "record", "check"]
