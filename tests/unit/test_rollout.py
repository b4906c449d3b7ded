"""The engine's rollout records on the device (MaxText/inference/rollout.py sampled_logprobs) and the
trainer's scoring of them (MaxText/post_train/policy_logprobs.py logprobs_of), against float64 numpy:
the kept size is the hand-computed top_p / top_k set, the logprob is renormalized over it; the trainer,
given that size, scores the same distribution."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference.rollout import sampled_logprobs
from MaxText.post_train.policy_logprobs import logprobs_of

V = 32
# (temperature, top_p, top_k) per row: unfiltered, top_p, top_k, both, greedy (filters ignored), hot top_p
OPTIONS = [(1.0, 1.0, 0), (1.0, 0.6, 0), (0.7, 1.0, 5), (1.3, 0.8, 4), (0.0, 0.5, 3), (2.0, 0.3, 0)]


def np_kept_and_logprob(lg, tok, temp, p, k):
  """float64: the kept set (sorted by logit, ties lowest id first; mass strictly ahead < top_p, rank <
  top_k) and tok's log-prob renormalized over it at temperature (greedy: the raw log-softmax)."""
  lg = np.asarray(lg, np.float64)
  if temp == 0 or (p >= 1 and k <= 0):
    z = lg / (temp or 1.0)
    return V, z[tok] - np.log(np.exp(z - z.max()).sum()) - z.max()
  order = np.argsort(-lg, kind="stable")
  z = lg[order] / temp
  probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  before = np.cumsum(probs) - probs
  keep = (before < p) & ((k <= 0) | (np.arange(V) < k))
  kz = z[keep]
  lse = kz.max() + np.log(np.exp(kz - kz.max()).sum())
  return int(keep.sum()), z[list(order).index(tok)] - lse


def test_kept_size_and_logprob_are_the_hand_computed_top_p_top_k_set():
  logits = jax.random.normal(jax.random.key(0), (len(OPTIONS), V)) * 2.0  # [B,V]
  temp, top_p, top_k = (jnp.asarray(c) for c in zip(*OPTIONS))
  order = np.argsort(-np.asarray(logits), axis=-1, kind="stable")
  tokens = jnp.asarray(order[np.arange(len(OPTIONS)), [0, 1, 0, 2, 0, 0]], jnp.int32)  # each inside its row's kept set
  logp, kept = jax.jit(sampled_logprobs)(logits, tokens, temp, top_p, top_k)
  for b, opts in enumerate(OPTIONS):
    want_kept, want_lp = np_kept_and_logprob(logits[b], int(tokens[b]), *opts)
    assert int(kept[b]) == want_kept, (b, opts)
    np.testing.assert_allclose(float(logp[b]), want_lp, atol=1e-5, err_msg=str(opts))
  assert 1 < int(kept[1]) < V and int(kept[2]) == 5  # the cases that matter are not trivial


def test_trainer_scores_the_recorded_kept_set_at_the_recorded_temperature():
  logits = jax.random.normal(jax.random.key(1), (2, 5, V)) * 2.0  # [B,T,V]: position t scores token t+1
  tokens = jnp.asarray(np.argsort(-np.asarray(logits), axis=-1)[:, :, 1], jnp.int32)  # [B,T] second best
  tokens = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tokens[:, :-1]], axis=1)  # token t from position t-1
  kept = jnp.asarray([[V, 3, 1, 7, V], [V, 2, V, 4, 10]], jnp.int32)  # kept 1: the token is kept anyway
  logp = np.asarray(jax.jit(functools.partial(logprobs_of, temperature=0.8))(logits, tokens, kept=kept))
  assert (logp[:, 0] == 0).all()
  for b in range(2):
    for t in range(1, 5):
      lg = np.asarray(logits[b, t - 1], np.float64)
      keep = np.argsort(-lg, kind="stable")[:int(kept[b, t])].tolist() + [int(tokens[b, t])]
      z = lg[sorted(set(keep))] / 0.8
      want = lg[int(tokens[b, t])] / 0.8 - (z.max() + np.log(np.exp(z - z.max()).sum()))
      np.testing.assert_allclose(logp[b, t], want, atol=1e-5, err_msg=f"{b},{t}")


def _run_rollouts(prompts, stop_at, *, page_size=2, steps=60):
  """Host only: a Scheduler over a PageAllocator driven as the engine drives it, the device faked: the
  experts of position p are (p, p + 1), the drawn token is 100 + its position, its logprob -position,
  its kept size the position; a request stops (EOS 7) when its position reaches stop_at[i]."""
  from MaxText.inference.page_allocator import PageAllocator
  from MaxText.inference.rollout import RolloutRecorder
  from MaxText.inference.scheduler import SamplingParams, Scheduler
  alloc = PageAllocator(16, page_size)
  sched = Scheduler(alloc, max_num_seqs=1, max_num_tokens=8, chunk=4, max_length=32, eos_id=7, vocab_size=512)
  rec = RolloutRecorder(page_size, moe_layers=1, experts_per_tok=2)
  sched.rollout_shareable = rec.shareable
  requests = []
  for prompt in prompts:
    requests.append(sched.add(prompt, SamplingParams(max_tokens=4, rollout=True)))
    rec.start(requests[-1])
  for _ in range(steps):
    rows = sched.schedule()
    if not rows:
      break
    where = list(range(len(rows)))
    t = max(row.count for row in rows)
    pos = np.array([[row.start + j for j in range(t)] for row in rows])  # [B,t]
    experts = np.stack([pos, pos + 1], -1)[:, :, None, :].astype(np.int32)  # [B,t,1,2]
    nxt = np.array([row.start + row.known for row in rows])  # the drawn token's position
    stop = np.array([stop_at[requests.index(row.request)] for row in rows])
    sampled = np.where(nxt >= stop, 7, 100 + nxt)
    rec.record(rows, where, sampled, -nxt.astype(np.float32), nxt, experts)
    sched.update(rows, sampled)
    rec.publish(rows, alloc)
  return requests, alloc


def test_records_include_the_stop_token_and_shared_prefix_pages_get_their_routing():
  prompt = [1, 2, 3, 4, 5]  # two full pages of 2, shared by the second request
  (a, b), alloc = _run_rollouts([prompt, prompt], stop_at=[7, 99])
  assert alloc.hits >= 2  # b took a's cached pages: its positions 0..3 were not computed again
  assert a.output == [105, 106] and a.rollout.tokens == [105, 106, 7]  # the stop token ends the records
  assert a.rollout.logprobs == [-5.0, -6.0, -7.0] and a.rollout.kept == [5, 6, 7]
  for r in (a, b):
    n = len(r.prompt) + len(r.rollout.tokens)
    want = np.stack([np.arange(n), np.arange(n) + 1], -1)[:, None, :]  # [n,1,2]
    want[-1] = -1  # the last token is never fed to the model
    np.testing.assert_array_equal(r.rollout.routed_experts, want)
  assert len(b.rollout.tokens) == 4 and b.output == b.rollout.tokens
