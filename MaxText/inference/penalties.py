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

Stages 1-3 change greedy rows too. Stage 1 is fixed per request (min_tokens: until reached): per step
`History.step_arrays` sends only the ids it touches, ids [B,S] int32 (V past a row's entries: dropped),
their biases [B,S] fp32 and bans [B,S] int32 (min_tokens: how many positions from the step's first the
id stays at -inf), S the smallest power of two >= 8 holding the step's fullest row.
Stages 2-3 need each row's history, kept on the device (`State`: seen [N,V] bool, prompt or output;
counts [N,V] int32, output only; N = serve_max_num_seqs rows, one per running request that penalizes,
its slot): each step sends only the tokens a row's slot has not seen yet (its whole prompt once, then
its new tokens: ids [B,D], D a power of two >= 8) and `update` adds them (O(new tokens) on the host and
in what travels, multi-process included); `apply` adjusts the [B,T,V] logits densely from the slots.
Speculative decoding (step_spec.py) verifies drafts at T = 1 + k positions: position j's history is the
slot's plus the row's drafts before j, and its min_tokens count is made + j, so each drawn token sees
what vLLM's rejection sampler gives it (the drafter's own distribution q is left as drawn: rejection
sampling keeps the adjusted target's distribution whatever q is).
A request that leaves the running set (finished, preempted) frees its slot; one that comes back gets
a fresh slot and sends its history again. `from_scratch` is the whole-history twin (the former per-step
rebuild): tests/unit/test_penalties.py checks the two agree over multi-step runs, benchmarks/penalties.py
times both. A step whose rows adjust sends both stages' arrays (padding where a stage has nothing); one
whose rows adjust nothing sends None and runs the step program without this stage. Any request's values
are data: only S picks a step program (D only `update`'s, a small one), never a request's numbers. The
State takes 5 bytes x N x V on the device (16 x 129280: 10 MiB), made by the first step that adjusts.
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
  return bool(params.logit_bias or params.min_tokens or penalizes(params))


def penalizes(params) -> bool:
  """Whether a request sets stages 2-3 (its history's penalties)."""
  return bool(params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty)


def stage1(params, made: int, eos_id: int | None) -> dict[int, list]:
  """One row's stage 1 from the tokens it has made: id -> [bias, ban], ban the number of positions from here on
  at which the id is at -inf (min_tokens - made for EOS and stop_token_ids while min_tokens is not reached)."""
  out: dict[int, list] = collections.defaultdict(lambda: [0.0, 0])
  for tok, bias in params.logit_bias:
    out[tok][0] += bias
  if made < params.min_tokens:
    stops = set(params.stop_token_ids) - set(params.stop_string_ids)
    stops |= set() if params.ignore_eos or eos_id is None else {eos_id}
    for tok in stops:
      out[tok][1] = params.min_tokens - made
  return out


def row_entries(params, prompt: Sequence[int], output: Sequence[int], eos_id: int | None) -> dict[int, list]:
  """One row's adjusted ids -> [bias, repetition factor, subtracted penalty] (from_scratch's, stages 1-3)."""
  out: dict[int, list] = collections.defaultdict(lambda: [0.0, 1.0, 0.0])
  for tok, (bias, ban) in stage1(params, len(output), eos_id).items():
    out[tok][0] = -np.inf if ban else bias
  if params.repetition_penalty != 1.0:
    for tok in set(prompt) | set(output):
      out[tok][1] = params.repetition_penalty
  if params.frequency_penalty or params.presence_penalty:
    for tok, n in collections.Counter(output).items():
      out[tok][2] = params.frequency_penalty * n + params.presence_penalty
  return out


def _width(n: int) -> int:
  """The smallest power of two >= max(8, n): the few widths a step's sparse arrays take."""
  return max(_MIN_WIDTH, 1 << (max(n, 1) - 1).bit_length())


def from_scratch(rows: Sequence, where: Sequence[int], b: int, vocab: int, eos_id: int | None):
  """The whole-history twin of History.step_arrays + apply: every stage 1-3 entry of each sampling row that
  adjusts, rebuilt from its prompt and output -> (ids [b,S] int32, values [b,S,3] fp32) for `apply_entries`,
  or None when no row has an entry. O(prompt + output) a row a step: the reference, not the engine's path."""
  per = {i: entries for i, row in zip(where, rows) if row.samples and adjusts(row.request.params)
         if (entries := row_entries(row.request.params, row.request.prompt, row.request.output, eos_id))}
  if not per:
    return None
  s = _width(max(len(e) for e in per.values()))
  ids = np.full((b, s), vocab, np.int32)  # V: out of range, the scatter drops it
  vals = np.zeros((b, s, 3), np.float32)
  vals[..., 1] = 1.0
  for i, entries in per.items():
    ids[i, :len(entries)] = list(entries)
    vals[i, :len(entries)] = list(entries.values())
  return ids, vals


def apply_entries(logits: jax.Array, ids: jax.Array, vals: jax.Array) -> jax.Array:
  """from_scratch's stages 1-3: logits [B,V] fp32, ids [B,S] (distinct per row; V = none), vals [B,S,3]
  -> logits [B,V]."""
  v = logits.shape[-1]
  got = jnp.take_along_axis(logits, jnp.minimum(ids, v - 1), axis=-1) + vals[..., 0]  # [B,S] biased
  rep = vals[..., 1]
  new = jnp.where(got > 0, got / rep, got * rep) - vals[..., 2]  # [B,S]
  rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], ids.shape)  # [B,S]
  return logits.at[rows, ids].set(new, mode="drop")


class History:
  """Process 0's side of stages 1-3: each running request that penalizes holds a slot of the device State (one
  of `slots` rows) and the number of its tokens (prompt, then output) the slot has been sent."""

  def __init__(self, slots: int):
    self.slots = slots
    self.slot: dict = {}  # Request (hashed by identity) -> its row of State
    self.sent: dict = {}  # Request -> how many of prompt + output its row holds

  def step_arrays(self, rows: Sequence, where: Sequence[int], b: int, vocab: int, eos_id: int | None,
                  running: Sequence):
    """The step's (bias, pen) for its sampling rows that adjust, or None when none does.
    bias: (ids [b,S] int32 (V: none), biases [b,S] fp32, bans [b,S] int32), stage1's entries;
    pen: (slot [b] int32 (`slots`: none), reset [b] bool (a slot's first step: zeroed before its tokens),
    ids [b,D] int32 (V: none), out [b,D] bool (an output token, counted; else a prompt one, only seen),
    factors [b,3] fp32 (repetition, frequency, presence; (1, 0, 0) for a row without)).
    Both are sent whenever a row adjusts, padding where nothing is (one step variant, not one per mix of stages).
    running: the scheduler's running requests (the others' slots are freed)."""
    adjusting = [(i, row.request) for i, row in zip(where, rows) if row.samples and adjusts(row.request.params)]
    if not adjusting:
      return None
    live = set(running)
    for r in [r for r in self.slot if r not in live]:
      del self.slot[r], self.sent[r]
    return _bias_arrays(adjusting, b, vocab, eos_id), self._new_tokens(
        [(i, r) for i, r in adjusting if penalizes(r.params)], b, vocab)

  def _new_tokens(self, rows: list, b: int, vocab: int):
    """pen of step_arrays for rows [(batch row, Request)] that penalize: each one's tokens its slot lacks."""
    free = sorted(set(range(self.slots)) - set(self.slot.values()))
    slot, reset = np.full(b, self.slots, np.int32), np.zeros(b, bool)
    factors = np.tile(np.array([1.0, 0.0, 0.0], np.float32), (b, 1))
    new = {}
    for i, r in rows:
      if r not in self.slot:
        self.slot[r], self.sent[r], reset[i] = free.pop(0), 0, True
      n, p = self.sent[r], len(r.prompt)
      new[i] = ([*r.prompt[n:], *r.output[max(0, n - p):]], max(0, p - n))  # (tokens, how many are the prompt's)
      self.sent[r] = p + len(r.output)
      slot[i] = self.slot[r]
      factors[i] = r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty
    d = _width(max((len(toks) for toks, _ in new.values()), default=0))
    ids, out = np.full((b, d), vocab, np.int32), np.zeros((b, d), bool)
    for i, (toks, prompt) in new.items():
      ids[i, :len(toks)] = toks
      out[i, prompt:len(toks)] = True
    return slot, reset, ids, out, factors


def _bias_arrays(rows: list, b: int, vocab: int, eos_id: int | None):
  """bias of step_arrays for rows [(batch row, Request)]: stage 1's (ids [b,S], biases [b,S], bans [b,S])."""
  per = {i: e for i, r in rows if (e := stage1(r.params, len(r.output), eos_id))}
  s = _width(max((len(e) for e in per.values()), default=0))
  ids, biases, bans = np.full((b, s), vocab, np.int32), np.zeros((b, s), np.float32), np.zeros((b, s), np.int32)
  for i, entries in per.items():
    ids[i, :len(entries)] = list(entries)
    biases[i, :len(entries)], bans[i, :len(entries)] = zip(*entries.values())
  return ids, biases, bans


State = tuple  # (seen [N,V] bool: the id is in the slot's prompt or output; counts [N,V] int32: in its output)


def init_state(slots: int, vocab: int, sharding=None) -> State:
  """Every slot empty (sharding: where the step's programs read it, e.g. replicated over a mesh; None: default)."""
  state = (jnp.zeros((slots, vocab), jnp.bool_), jnp.zeros((slots, vocab), jnp.int32))
  return state if sharding is None else jax.device_put(state, sharding)


def _update(state: State, slot, reset, ids, out) -> State:
  seen, counts = state
  n = seen.shape[0]
  fresh = jnp.where(reset, slot, n)  # [B] the slots zeroed first; n: none (dropped)
  seen, counts = seen.at[fresh].set(False, mode="drop"), counts.at[fresh].set(0, mode="drop")
  rows = jnp.broadcast_to(slot[:, None], ids.shape)  # [B,D]
  seen = seen.at[rows, ids].set(True, mode="drop")
  counts = counts.at[rows, jnp.where(out, ids, seen.shape[1])].add(1, mode="drop")  # repeats add up
  return seen, counts


_update_donated = jax.jit(_update, donate_argnums=(0,))


def update(state: State, slot, reset, ids, out) -> State:
  """State with pen's new tokens (History.step_arrays): reset slots zeroed, then every token seen, output ones
  counted (state donated: updated in place)."""
  return _update_donated(state, *(jnp.asarray(a) for a in (slot, reset, ids, out)))


def device_inputs(state: State | None, adjust, slots: int, vocab: int, sharding=None):
  """History.step_arrays' host arrays -> (the State with their new tokens (made here when None), apply's (bias,
  pen) on the device)."""
  bias, (slot, reset, ids, out, factors) = adjust
  state = update(init_state(slots, vocab, sharding) if state is None else state, slot, reset, ids, out)
  return state, (tuple(jnp.asarray(a) for a in bias), (state, jnp.asarray(slot), jnp.asarray(factors)))


def apply(logits: jax.Array, bias, pen, drafts: jax.Array | None = None) -> jax.Array:
  """Stages 1-3 on logits [B,T,V] fp32 at T consecutive positions of each row, position j after the row's
  tokens and its drafts[:, :j] (speculative verification: T = 1 + k; else T = 1 and drafts None).
  bias: (ids [B,S] (V = none), biases [B,S], bans [B,S]: the id is at -inf at positions j < ban); pen: (State,
  slot [B] (N = none), factors [B,3]); drafts [B,T-1] (V = none). A row without a slot has factors (1, 0, 0):
  its logits are unchanged by stages 2-3."""
  b, t, v = logits.shape
  ids, biases, bans = bias
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)  # [B,S]
  add = jnp.zeros((b, v), jnp.float32).at[rows, ids].add(biases, mode="drop")  # [B,V]
  ban = jnp.zeros((b, v), jnp.int32).at[rows, ids].max(bans, mode="drop")  # [B,V]
  logits = jnp.where(jnp.arange(t)[None, :, None] < ban[:, None], -jnp.inf, logits + add[:, None])  # [B,T,V]
  (seen, counts), slot, factors = pen
  at = jnp.minimum(slot, seen.shape[0] - 1)  # [B]
  seen, counts = seen[at][:, None], counts[at][:, None].astype(jnp.float32)  # [B,1,V] each
  if drafts is not None:  # position j's history also holds drafts[:, :j] (output tokens)
    hot = jax.nn.one_hot(drafts, v, dtype=jnp.float32)  # [B,T-1,V]; V: a zero row
    before = jnp.concatenate([jnp.zeros((b, 1, v), jnp.float32), jnp.cumsum(hot, axis=1)], axis=1)  # [B,T,V]
    seen, counts = seen | (before > 0), counts + before  # [B,T,V] each
  r, f, p = (factors[:, None, i:i + 1] for i in range(3))  # [B,1,1] each
  logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
  return logits - f * counts - p * (counts > 0)


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


__all__ = ["History", "State", "adjusts", "penalizes", "stage1", "row_entries", "from_scratch", "apply_entries",
           "init_state", "update", "device_inputs", "apply", "min_p_filter"]
