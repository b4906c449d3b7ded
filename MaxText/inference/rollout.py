"""Rollouts for RL (DeepSeek-V3.2 sec. 3.1): what the engine records per token for a request that asks
(SamplingParams.rollout), so the trainer can score the same tokens the same way.

Per GENERATED token i (Rollout.tokens[i]: request.output, then the stop token when one ended it):
  logprobs[i]  log-prob of the token under the distribution it was drawn from: log softmax(logits /
               temperature) renormalized over the kept top_k / top_p set (temperature 0: the raw
               log-softmax over the whole vocabulary); ids past sample_vocab are never in the set;
  kept[i]      the size of that set (sampling.kept_sorted: top-k, then top-p over the top-k
               renormalized; ties lowest id first); unfiltered: the vocabulary (sample_vocab when set);
  kept_ids[i]  the set itself, its ids most likely first, when kept[i] <= KEPT_IDS (every top-k set with
               k <= KEPT_IDS); [] for a larger set (a wide top-p, or no filter), which the trainer rebuilds
               as the kept[i] largest of its own logits: exact for an unfiltered row, an approximation
               for a wide top-p set once the policy has moved (DeepSeek-V3.2 keeps the engine's mask).
Per POSITION p of prompt + tokens: routed_experts[p] [n_moe_layers, num_experts_per_tok] int32, the experts
each MoE layer routed the token at p to (keep routing); -1 where no step computed p: the last
generated token (never fed back) and nothing else. A request whose prompt shares cached prefix pages
did not compute them: the engine keeps, on the host, the routing of each full page a rollout
computed, keyed as the prefix cache keys its pages (page_allocator.page_hashes: the whole prefix up
to the page), and fills the shared positions from it; a rollout shares only pages whose routing is
kept (the scheduler asks `RolloutRecorder.shareable`).

On the device (`sampled_logprobs`, inside the engine's rollout step program: a step with a rollout
row runs it, others the plain one) only [B] values, the kept ids [B,KEPT_IDS] and the step's routing
[B,t,L,k] leave the device, never [B,V]. The trainer's side is MaxText/post_train/policy_logprobs.py: before any update its
log-probs of these tokens, with these experts forced and this kept set, equal `logprobs`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference.page_allocator import PageAllocator, page_hashes
from MaxText.inference.sampling import kept_sorted  # the one definition of the kept set

KEPT_IDS = 64  # a kept set of at most this many ids is recorded as its ids; a larger one (a wide top-p) as its size


@dataclasses.dataclass
class Rollout:
  """A rollout request's records (see the module docstring); routed_experts has a row per position."""
  routed_experts: np.ndarray  # [positions, n_moe_layers, k] int32, -1 where not computed
  tokens: list[int] = dataclasses.field(default_factory=list)  # generated, the stop token included
  logprobs: list[float] = dataclasses.field(default_factory=list)
  kept: list[int] = dataclasses.field(default_factory=list)
  kept_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [] where kept > KEPT_IDS


def sampled_logprobs(logits: jax.Array, ids: jax.Array, temperature: jax.Array, top_p: jax.Array,
                     top_k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """logits [B,V] fp32 (ids past sample_vocab at -inf), ids [B] the drawn tokens, options [B] as
  sampling.sample_rows -> (logp [B] fp32 of each id under the distribution it was drawn from, kept [B]
  int32 the size of its kept set (every finite logit when the row does not filter or is greedy),
  kept_ids [B, min(KEPT_IDS, V)] int32 the set's ids most likely first, -1 past its size)."""
  def one(lg, tok, temp, p, k):  # [V], [], ...
    order, sorted_lg, keep = kept_sorted(lg, temp, p, k)  # [V] each, most likely first
    filtered = (temp > 0) & ((p < 1) | (k > 0))
    keep = jnp.where(filtered, keep, jnp.isfinite(lg[order]))  # [V]
    scaled = jnp.where(temp > 0, sorted_lg, lg[order])  # [V]: temperature 0 scores the raw log-softmax
    lsm = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf))  # [V] in sorted order
    c = min(KEPT_IDS, lg.shape[0])
    return (jnp.sum(jnp.where(order == tok, lsm, 0.0)), jnp.sum(keep, dtype=jnp.int32),
            jnp.where(keep[:c], order[:c], -1).astype(jnp.int32))  # keep is a prefix of the sorted order

  return jax.vmap(one)(logits.astype(jnp.float32), ids, temperature, top_p, top_k)


def wants(rows: Sequence) -> bool:
  """Whether any of a step's rows is a rollout's (the step then runs the rollout program)."""
  return any(row.request.params.rollout for row in rows)


class RolloutRecorder:
  """The engine's host side: each rollout request's records, and the routing of the full prefix pages
  rollouts computed (prefix key -> [page_size, L, k]), kept while the allocator caches the page."""

  def __init__(self, page_size: int, moe_layers: int, experts_per_tok: int):
    self.page_size, self.shape = page_size, (moe_layers, experts_per_tok)
    self.pages: dict[bytes, np.ndarray] = {}

  def start(self, request) -> None:
    """Gives a new rollout request its empty records (a row per position it may reach)."""
    n = len(request.prompt) + request.params.max_tokens
    request.rollout = Rollout(np.full((n,) + self.shape, -1, np.int32))

  def shareable(self, prompt: Sequence[int], pages: int) -> int:
    """How many of a prompt's first `pages` cached pages have their routing kept (a rollout shares those)."""
    keys = page_hashes(list(prompt[:pages * self.page_size]), self.page_size)
    return next((i for i, key in enumerate(keys) if key not in self.pages), len(keys))

  def record(self, rows: Sequence, where: Sequence[int], sampled: np.ndarray, logp: np.ndarray, kept: np.ndarray,
             kept_ids: np.ndarray, routed_experts: np.ndarray) -> None:
    """Stores a step's records in each rollout row's Request (call before scheduler.update). sampled,
    logp, kept [B], kept_ids [B,C], routed_experts [B,t,L,k] on the host; where: each row's batch row."""
    ps = self.page_size
    for row, i in zip(rows, where):
      r, ro = row.request, row.request.rollout
      if ro is None:
        continue
      before = ro.routed_experts[row.start - 1] if row.start else None  # [L,k]
      if before is not None and before.size and before[0, 0] < 0:  # after shared pages
        for j, key in enumerate(page_hashes(r.tokens[:row.start], ps)):
          ro.routed_experts[j * ps:(j + 1) * ps] = self.pages[key]
      ro.routed_experts[row.start:row.start + row.known] = routed_experts[i, :row.known]
      if row.samples:
        ro.tokens.append(int(sampled[i]))
        ro.logprobs.append(float(logp[i]))
        ro.kept.append(int(kept[i]))
        ro.kept_ids.append(kept_ids[i, :kept[i]].tolist() if kept[i] <= KEPT_IDS else [])

  def publish(self, rows: Sequence, allocator: PageAllocator) -> None:
    """After scheduler.update: keeps the routing of the full pages this step's rollout rows completed;
    a finished rollout's routed_experts are cut to its positions and pages no longer cached are forgotten."""
    ps = self.page_size
    for row in rows:
      r, ro = row.request, row.request.rollout
      if ro is None:
        continue
      done = r.computed if r.finish_reason is None else min(r.computed, len(r.tokens))
      if done // ps > row.start // ps:
        keys = page_hashes(r.tokens[:done], ps)
        for j in range(row.start // ps, done // ps):
          self.pages[keys[j]] = ro.routed_experts[j * ps:(j + 1) * ps].copy()  # [page_size, L, k]
      if r.finish_reason is not None:
        ro.routed_experts = ro.routed_experts[:len(r.prompt) + len(ro.tokens)]
        self.pages = {key: v for key, v in self.pages.items() if allocator.holds(key)}


__all__ = ["KEPT_IDS", "Rollout", "RolloutRecorder", "sampled_logprobs", "wants"]
