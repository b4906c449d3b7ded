"""The engine's rollout records on the device (MaxText/inference/rollout.py sampled_logprobs) and the
trainer's scoring of them (MaxText/post_train/policy_logprobs.py logprobs_of), against float64 numpy:
the kept set is the hand-computed top-k-then-top-p set (its size and ids), the logprob is renormalized
over it; the trainer, given the recorded ids, scores the same distribution whatever its own logits."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference import sampling
from MaxText.inference.rollout import KEPT_IDS, sampled_logprobs
from MaxText.post_train.policy_logprobs import logprobs_of

V = 32
# (temperature, top_p, top_k) per row: unfiltered, top_p, top_k, both, greedy (filters ignored), hot top_p
OPTIONS = [(1.0, 1.0, 0), (1.0, 0.6, 0), (0.7, 1.0, 5), (1.3, 0.6, 4), (0.0, 0.5, 3), (2.0, 0.3, 0)]


def np_kept_and_logprob(lg, tok, temp, p, k):
  """float64: the kept ids (sorted by logit, ties lowest id first; rank < top_k or tied with the k-th, then the mass strictly
  ahead < top_p over the top-k renormalized, as vLLM / HF) and tok's log-prob renormalized over them at
  temperature (greedy or unfiltered: every id; greedy scores the raw log-softmax)."""
  lg = np.asarray(lg, np.float64)
  if temp == 0 or (p >= 1 and k <= 0):
    z = lg / (temp or 1.0)
    return np.argsort(-lg, kind="stable").tolist(), z[tok] - np.log(np.exp(z - z.max()).sum()) - z.max()
  order = np.argsort(-lg, kind="stable")
  z = lg[order] / temp
  top = order[z >= z[k - 1]] if k > 0 else order  # the k most likely and their ties
  zk = z[:len(top)]
  probs = np.exp(zk - zk.max()) / np.exp(zk - zk.max()).sum()  # the top-k renormalized
  before = np.cumsum(probs) - probs
  ids = [int(i) for i, b in zip(top, before) if b < p]
  kz = z[:len(ids)]
  lse = kz.max() + np.log(np.exp(kz - kz.max()).sum())
  return ids, z[list(order).index(tok)] - lse


def test_kept_set_and_logprob_are_the_hand_computed_top_k_then_top_p_set():
  logits = jax.random.normal(jax.random.key(0), (len(OPTIONS), V)) * 2.0  # [B,V]
  temp, top_p, top_k = (jnp.asarray(c) for c in zip(*OPTIONS))
  order = np.argsort(-np.asarray(logits), axis=-1, kind="stable")
  tokens = jnp.asarray(order[np.arange(len(OPTIONS)), [0, 1, 0, 1, 0, 0]], jnp.int32)  # each inside its row's kept set
  logp, kept, kept_ids = jax.jit(sampled_logprobs)(logits, tokens, temp, top_p, top_k)
  assert kept_ids.shape == (len(OPTIONS), min(KEPT_IDS, V))
  for b, opts in enumerate(OPTIONS):
    want_ids, want_lp = np_kept_and_logprob(logits[b], int(tokens[b]), *opts)
    assert int(kept[b]) == len(want_ids), (b, opts)
    ids = np.asarray(kept_ids[b])
    assert ids[:len(want_ids)].tolist() == want_ids[:len(ids)] and (ids[len(want_ids):] == -1).all(), (b, opts)
    np.testing.assert_allclose(float(logp[b]), want_lp, atol=1e-5, err_msg=str(opts))
  assert 1 < int(kept[1]) < V and int(kept[2]) == 5 and int(kept[3]) == 3  # not trivial; row 3: 4 if top-p saw the whole distribution


def test_top_p_is_measured_over_the_top_k_renormalized():
  """The issue's case: probs [.5, .3, .2], k = 2, p = .6: vLLM and HF keep {0} (.5 / .8 >= .6); top-p over
  the whole distribution would keep {0, 1}."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]]))
  one = lambda a: jnp.asarray([a])  # noqa: E731
  _, kept, kept_ids = sampled_logprobs(logits, one(0), one(1.0), one(0.6), one(2))
  assert int(kept[0]) == 1 and np.asarray(kept_ids[0]).tolist() == [0, -1, -1]
  keep = np.asarray(sampling.kept_mask(logits, 1.0, 0.6, 2))
  assert keep.tolist() == [[True, False, False]]


def test_top_k_keeps_every_token_tied_with_the_kth_in_the_engine_and_the_rl_set_alike():
  """vLLM's and HF's top-k: logits [2, 2, 1, 0], k = 1 keep {0, 1} (not the lowest id alone); the engine's draws
  and the set RL records are that one set."""
  logits = jnp.asarray([[2.0, 2.0, 1.0, 0.0]])
  one = lambda a: jnp.asarray([a])  # noqa: E731
  assert np.asarray(sampling.kept_mask(logits, 1.0, 1.0, 1)).tolist() == [[True, True, False, False]]
  _, kept, kept_ids = sampled_logprobs(logits, one(1), one(1.0), one(1.0), one(1))
  assert int(kept[0]) == 2 and np.asarray(kept_ids[0]).tolist()[:2] == [0, 1]
  keys = jax.random.split(jax.random.key(0), 200)
  draws = jax.vmap(lambda k: sampling.sample_rows(logits, k[None], one(1.0), one(1.0), one(1)))(keys)  # [n,1]
  assert set(np.asarray(draws).ravel().tolist()) == {0, 1}


def test_trainer_scores_the_recorded_kept_set_at_the_recorded_temperature():
  """Where the recorded size fits KEPT_IDS the trainer scores over the recorded ids (not this model's top-n),
  past it over the n largest of its logits, and an unfiltered position (n = V) over everything."""
  logits = jax.random.normal(jax.random.key(1), (2, 5, V)) * 2.0  # [B,T,V]: position t scores token t+1
  order = np.argsort(-np.asarray(logits), axis=-1, kind="stable")  # [B,T,V]
  tokens = jnp.asarray(order[:, :, 1], jnp.int32)  # [B,T] second best
  tokens = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tokens[:, :-1]], axis=1)  # token t from position t-1
  kept = np.asarray([[V, 3, 1, 7, V], [V, 2, V, 4, 10]], np.int32)  # kept 1: the token is kept anyway
  c = 4  # a record of 4 ids: sizes 7 and 10 are past it (rebuilt from these logits)
  ids = np.full((2, 5, c), -1, np.int32)
  rng = np.random.default_rng(0)
  for b in range(2):
    for t in range(1, 5):
      if kept[b, t] <= c:  # the engine's set: NOT this model's top-n (the policy moved)
        ids[b, t, :kept[b, t]] = rng.choice(V, kept[b, t], replace=False)
  logp = np.asarray(jax.jit(functools.partial(logprobs_of, temperature=0.8))(
      logits, tokens, kept=jnp.asarray(kept), kept_ids=jnp.asarray(ids)))
  assert (logp[:, 0] == 0).all()
  for b in range(2):
    for t in range(1, 5):
      lg = np.asarray(logits[b, t - 1], np.float64)
      n = int(kept[b, t])
      keep = (ids[b, t, :n].tolist() if n <= c else order[b, t - 1, :n].tolist()) + [int(tokens[b, t])]
      z = lg[sorted(set(keep))] / 0.8
      want = lg[int(tokens[b, t])] / 0.8 - (z.max() + np.log(np.exp(z - z.max()).sum()))
      np.testing.assert_allclose(logp[b, t], want, atol=1e-5, err_msg=f"{b},{t}")


def test_the_engines_kept_set_not_the_moved_policys_top_n():
  """The issue's case: engine logits [3, 2, 1, 0], top-k 2, token 1 drawn; the current policy's logits
  [3, 1, 2, 0]: over the engine's set {0, 1} -2.127; the rebuilt top-2 of the current logits would give -2.408.
  The reference policy scores over the same recorded set (its logits are any others)."""
  _, kept, kept_ids = sampled_logprobs(jnp.asarray([[3.0, 2.0, 1.0, 0.0]]), jnp.asarray([1]), jnp.asarray([1.0]),
                                       jnp.asarray([1.0]), jnp.asarray([2]))
  tokens = jnp.asarray([[0, 1]])
  score = lambda lg: float(logprobs_of(jnp.asarray([[lg, [0.0] * 4]]), tokens, temperature=1.0,  # noqa: E731
                                       kept=jnp.asarray([[4, int(kept[0])]]), kept_ids=jnp.repeat(kept_ids[None], 2, axis=1))[0, 1])
  np.testing.assert_allclose(score([3.0, 1.0, 2.0, 0.0]), 1 - np.log(np.exp(3) + np.exp(1)), atol=1e-5)  # -2.127
  np.testing.assert_allclose(score([0.0, 0.5, 5.0, 4.0]), 0.5 - np.log(1 + np.exp(0.5)), atol=1e-5)  # the reference


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
    kept_ids = np.where(np.arange(8) < nxt[:, None], 200 + np.arange(8), -1)  # [B,8]: sets of size <= 8 recorded
    rec.record(rows, where, sampled, -nxt.astype(np.float32), nxt, kept_ids, experts)
    sched.update(rows, sampled)
    rec.publish(rows, alloc)
  return requests, alloc


def test_records_include_the_stop_token_and_shared_prefix_pages_get_their_routing(monkeypatch):
  from MaxText.inference import rollout
  monkeypatch.setattr(rollout, "KEPT_IDS", 6)  # sets of up to 6 ids recorded as ids, 7 as its size only
  prompt = [1, 2, 3, 4, 5]  # two full pages of 2, shared by the second request
  (a, b), alloc = _run_rollouts([prompt, prompt], stop_at=[7, 99])
  assert alloc.hits >= 2  # b took a's cached pages: its positions 0..3 were not computed again
  assert a.output == [105, 106] and a.rollout.tokens == [105, 106, 7]  # the stop token ends the records
  assert a.rollout.logprobs == [-5.0, -6.0, -7.0] and a.rollout.kept == [5, 6, 7]
  assert a.rollout.kept_ids == [list(range(200, 205)), list(range(200, 206)), []]
  for r in (a, b):
    n = len(r.prompt) + len(r.rollout.tokens)
    want = np.stack([np.arange(n), np.arange(n) + 1], -1)[:, None, :]  # [n,1,2]
    want[-1] = -1  # the last token is never fed to the model
    np.testing.assert_array_equal(r.rollout.routed_experts, want)
  assert len(b.rollout.tokens) == 4 and b.output == b.rollout.tokens


def test_rollout_arrays_put_each_record_at_its_token_and_nothing_elsewhere():
  """Generated token i sits at t = len(prompt) + i: its logprob, kept size and ids there, the vocabulary
  (every id) and -1 (no ids) on the prompt and the padding; segment 1 up to the last token only."""
  from MaxText.inference.rollout import Rollout
  from MaxText.post_train.policy_logprobs import rollout_arrays
  experts = np.arange(5)[:, None, None] * np.ones((1, 1, 2), np.int32)  # [5,1,2]: position p routed to p
  ro = Rollout(experts, [8, 9], [-0.5, -1.5], [2, KEPT_IDS + 1], [[9, 8], []])  # the second set past the cap
  r = types.SimpleNamespace(prompt=[1, 2, 3], rollout=ro)
  a = rollout_arrays([r], 7, 50, 1, 2)
  np.testing.assert_array_equal(a["tokens"][0], [1, 2, 3, 8, 9, 0, 0])
  np.testing.assert_array_equal(a["segment_ids"][0], [1, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(a["generated"][0], [0, 0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(a["logp_old"][0], [0, 0, 0, -0.5, -1.5, 0, 0])
  np.testing.assert_array_equal(a["kept"][0], [50, 50, 50, 2, KEPT_IDS + 1, 50, 50])
  assert a["kept_ids"].shape == (1, 7, KEPT_IDS) and a["kept_ids"][0, 3, :3].tolist() == [9, 8, -1]
  assert (np.delete(a["kept_ids"][0], 3, axis=0) == -1).all()
  np.testing.assert_array_equal(a["routed_experts"][0, :, 0, 0], [0, 1, 2, 3, 4, -1, -1])


def test_sample_vocab_bounds_every_distribution_and_the_last_id_below_it_is_in():
  """ids >= sample_vocab are never drawn: outside the softmax; the id sample_vocab - 1 is inside."""
  logits = jnp.asarray([[[0.0, 1.0, 2.0, 3.0, 9.0, 9.0], [0.0] * 6]])  # [1,2,6]
  tokens = jnp.asarray([[0, 3]])
  for sv in (4, 5):
    got = float(logprobs_of(logits, tokens, temperature=1.0, sample_vocab=sv)[0, 1])
    lg = np.asarray(logits[0, 0, :sv], np.float64)
    np.testing.assert_allclose(got, lg[3] - np.log(np.exp(lg).sum()), rtol=1e-6)
