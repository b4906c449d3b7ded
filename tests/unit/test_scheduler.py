"""MaxText/inference/scheduler.py with a stand-in model whose next token is a pure function of the
sequence: every request's output must equal the one it gets alone, under staggered arrivals,
shared prefixes, tight budgets and preemption; no request lost, duplicated or stuck; no page leaked."""

import random

import pytest

from MaxText.inference.page_allocator import PageAllocator
from MaxText.inference.scheduler import RequestError, SamplingParams, Scheduler

V, EOS = 50, 2


def next_token(tokens):
  """The stand-in model: a deterministic function of the whole sequence."""
  return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + 3) % V


def alone(prompt, params, max_length):
  """What one request gets by itself: the reference output."""
  out = []
  while True:
    tok = next_token(prompt + out)
    if tok in params.stop_token_ids or (not params.ignore_eos and tok == EOS):
      return out
    out.append(tok)
    if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_length:
      return out


def verify(row):
  """The stand-in target on one row: a row without drafts samples the token after its last token; a row with
  drafts gets the longest prefix of its drafts the model agrees with, then the model's next token."""
  seq = row.request.tokens[:row.start + row.known]
  accepted = []
  for d in row.drafts:
    if d != next_token(seq + accepted):
      break
    accepted.append(d)
  return accepted + [next_token(seq + accepted)]


def draft(tokens, k, rng, p_right=0.6):
  """A drafter right (the model's next token on the extended sequence) with probability p_right per draft."""
  drafts = []
  for _ in range(k):
    right = next_token(tokens + drafts)
    drafts.append(right if rng.random() < p_right else (right + rng.randrange(1, V)) % V)
  return drafts


def run(sched, arrivals, max_steps=2000, rng=None, runs=None):
  """arrivals: {step: [(prompt, params), ...]} -> requests; checks every step's budgets and rows. With
  sched.speculative = k, a drafter proposes k drafts (seeded by rng) for every request a step sampled and that
  still runs, as the engine does; runs (a list) collects (row, verified run) of every row with drafts."""
  requests, step, k = [], 0, sched.speculative
  while step < max_steps:
    for prompt, params in arrivals.get(step, []):
      requests.append(sched.add(prompt, params))
    if sched.idle and step > max(arrivals):
      break
    rows = sched.schedule()
    assert len(rows) <= sched.max_num_seqs and sum(r.count for r in rows) <= sched.max_num_tokens
    assert len({id(r.request) for r in rows}) == len(rows), "a request twice in one step"
    a = sched.allocator
    assert len({r.is_wide for r in rows}) <= 1, "decode rows and prefill chunks in one step"
    for row in rows:
      r = row.request
      assert row.start == r.computed and row.count >= 1
      assert len(r.pages) * a.page_size >= row.start + row.count, "a token without a page"
      assert len({a.shard_of(p) for p in r.pages}) == 1, "a sequence's pages span shards"
      if r.computed == len(r.tokens) - 1:  # a decode row: its newest token, then every draft it may verify
        room = min(r.params.max_tokens - len(r.output), sched.max_length - len(r.tokens)) - 1
        assert row.known == 1 and row.drafts == tuple(r.drafts[:max(0, min(k, room))]), (row, r.drafts)
      else:
        assert not row.drafts, "drafts on a prefill chunk"
    per_shard = [sum(a.shard_of(r.request.pages[0]) == s for r in rows) for s in range(a.shards)]
    assert max(per_shard) <= sched.max_num_seqs // a.shards, per_shard
    sampled = [verify(r) for r in rows]
    samples = [row.samples for row in rows]  # (update grows the sequences `samples` reads)
    sched.update(rows, sampled)
    if runs is not None:
      runs += [(row, got) for row, got in zip(rows, sampled) if row.drafts]
    stepped = {id(row.request) for row in rows}
    for r in sched.running:
      if id(r) not in stepped:
        r.drafts = []  # unverified drafts are dropped (the engine's draft distributions are replaced)
    for row, sampling in zip(rows, samples):
      r = row.request
      if sampling and r.finish_reason is None:
        assert r.computed == len(r.tokens) - 1, "accepted drafts count as computed, rejected ones do not"
        if k:
          r.drafts = draft(r.tokens, k, rng)
    sched.allocator.check()
    step += 1
  assert sched.idle, f"requests stuck after {max_steps} steps"
  return requests


def mixed_arrivals(rng, n=14):
  """n requests: half share a system prompt, staggered over 12 steps, with EOS, stop tokens and max_tokens."""
  system = [rng.randrange(3, V) for _ in range(9)]  # a shared "system prompt"
  arrivals = {}
  for i in range(n):
    prompt = (system if i % 2 else []) + [rng.randrange(3, V) for _ in range(rng.randrange(1, 11))]
    params = SamplingParams(max_tokens=rng.randrange(1, 9), ignore_eos=i % 3 == 0,
                            stop_token_ids=(7,) if i % 5 == 0 else ())
    arrivals.setdefault(rng.randrange(0, 12), []).append((prompt, params))
  return arrivals


@pytest.mark.parametrize("pages,budget,seqs,shards", [(64, 64, 8, 1), (9, 12, 4, 1), (7, 6, 3, 1), (64, 64, 8, 4),
                                                      (16, 12, 4, 2)])
def test_outputs_equal_each_request_alone_under_any_budget_and_preemption(pages, budget, seqs, shards):
  # shards > 1: a page pool split as on a mesh (each sequence's pages in one shard, its own rows' device)
  arrivals = mixed_arrivals(random.Random(pages))
  sched = Scheduler(PageAllocator(pages, page_size=4, shards=shards), max_num_seqs=seqs, max_num_tokens=budget,
                    chunk=4, max_length=32, eos_id=EOS, vocab_size=V)
  requests = run(sched, arrivals)
  assert len(requests) == 14 and len(sched.finished) == 14
  for r in requests:
    assert r.finish_reason in ("stop", "length")
    assert r.output == alone(r.prompt, r.params, 32), r.id
  assert sched.allocator.used_pages == 0
  if pages in (7, 16):
    assert sum(r.preemptions for r in requests) > 0  # the tight pool really preempted
  if pages == 64:
    assert sched.allocator.hits > 0  # the system prompt's pages were shared


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("pages,budget,seqs,shards", [(64, 64, 8, 1), (9, 12, 4, 1), (7, 6, 2, 1), (16, 12, 4, 2)])
def test_speculative_drafts_keep_each_output_equal_to_the_request_alone(pages, budget, seqs, shards, k):
  # run() checks each step: a decode row costs 1 + its drafts, every draft position has a page, accepted
  # drafts count as computed; here: greedy identity, some drafts accepted and some rejected, no page leaked
  sched = Scheduler(PageAllocator(pages, page_size=4, shards=shards), max_num_seqs=seqs, max_num_tokens=budget,
                    chunk=4, max_length=32, eos_id=EOS, vocab_size=V, speculative=k)
  runs = []
  requests = run(sched, mixed_arrivals(random.Random(pages + k)), rng=random.Random(k), runs=runs)
  assert len(requests) == 14 and len(sched.finished) == 14
  for r in requests:
    assert r.finish_reason in ("stop", "length")
    assert r.output == alone(r.prompt, r.params, 32), r.id
  assert sched.allocator.used_pages == 0
  assert any(len(got) > 1 for _, got in runs) and any(len(got) <= len(row.drafts) for row, got in runs)
  if pages in (7, 16):
    assert sum(r.preemptions for r in requests) > 0  # the tight pool really preempted


def test_a_stop_or_max_tokens_inside_an_accepted_run_ends_the_request_there():
  prompt = [11, 12, 13]
  o = alone(prompt, SamplingParams(max_tokens=8, ignore_eos=True), 32)
  stop = next(t for i, t in enumerate(o) if i >= 2 and t not in o[:i])  # a token that first appears at o[i]
  i = o.index(stop)
  sched = Scheduler(PageAllocator(16, page_size=4), max_num_seqs=2, max_num_tokens=8, chunk=4, max_length=32,
                    eos_id=None, vocab_size=V, speculative=i)
  s = sched.add(prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
  m = sched.add(prompt + [40], SamplingParams(max_tokens=2))
  rows = sched.schedule()  # both prompts, each sampling its first token
  sched.update(rows, [verify(row) for row in rows])
  right = {id(s): o[1:1 + i], id(m): alone(m.prompt, m.params, 32)[1:] + [5]}  # every draft the model's token
  s.drafts, m.drafts = right[id(s)], right[id(m)]
  rows = sched.schedule()
  assert [len(row.drafts) for row in rows] == [i, 0]  # m's max_tokens leaves room for no draft
  done = sched.update(rows, [verify(row) for row in rows])
  assert verify(rows[0]) == o[1:i + 2]  # every draft accepted: the stop token, then one more
  assert done == [s, m] and s.finish_reason == "stop" and m.finish_reason == "length"
  assert s.output == o[:i] == alone(s.prompt, s.params, 32) and len(m.output) == 2
  assert s.computed == len(s.tokens) and sched.allocator.used_pages == 0  # the entries after the stop do not count


def test_a_cached_prefix_is_not_recomputed():
  sched = Scheduler(PageAllocator(16, page_size=4), max_num_seqs=4, max_num_tokens=64, chunk=64, max_length=64,
                    eos_id=None, vocab_size=V)
  prompt = list(range(3, 14))  # 11 tokens: 2 full pages
  run(sched, {0: [(prompt, SamplingParams(max_tokens=2))]})
  r = sched.add(prompt + [20], SamplingParams(max_tokens=2))
  rows = sched.schedule()
  assert rows[0].request is r and rows[0].start == 8  # two shared pages, computed from token 8 on
  assert sched.allocator.hits == 2


def test_abort_frees_pages_at_once_and_the_others_finish():
  sched = Scheduler(PageAllocator(8, page_size=4), max_num_seqs=2, max_num_tokens=16, chunk=8, max_length=32,
                    eos_id=None, vocab_size=V)
  a = sched.add([5] * 6, SamplingParams(max_tokens=20))
  b = sched.add([6] * 3, SamplingParams(max_tokens=3))
  rows = sched.schedule()
  sched.update(rows, [next_token(r.request.tokens[:r.start + r.count]) for r in rows])
  held = sched.allocator.used_pages
  sched.abort(a)
  assert a.finish_reason == "abort" and sched.allocator.used_pages == held - 2
  run(sched, {0: []})
  assert b.finish_reason == "length" and b.output == alone(b.prompt, b.params, 32)
  assert sched.allocator.used_pages == 0


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(stop_token_ids=(V,)), "stop_token_ids"), (dict(seed=-1), "seed"),
    (dict(max_tokens=30), "max_tokens")])
def test_a_bad_request_names_its_field_and_leaves_the_queue_alone(kwargs, field):
  sched = Scheduler(PageAllocator(8, page_size=4), max_num_seqs=2, max_num_tokens=16, chunk=8, max_length=32,
                    eos_id=EOS, vocab_size=V)
  good = sched.add([4, 5], SamplingParams())
  with pytest.raises(RequestError) as e:
    sched.add([4, 5, 6], SamplingParams(**kwargs))
  assert e.value.field == field and field in str(e.value)
  for prompt, f in (([], "prompt"), ([V + 3], "prompt")):
    with pytest.raises(RequestError) as e:
      sched.add(prompt, SamplingParams())
    assert e.value.field == f
  assert list(sched.waiting) == [good]


@pytest.mark.parametrize("pages,max_length,why", [(16, 32, "context length 32"), (8, 64, "pages")])
def test_prompt_plus_max_tokens_fills_the_context_or_the_pool_exactly_and_one_more_is_refused(pages, max_length, why):
  """The context check and the pool check each on its own (a pool of 16 pages of 4 outlasts a 32-token
  context; a 64-token context outlasts a pool of 8 pages of 4)."""
  sched = Scheduler(PageAllocator(pages, page_size=4), max_num_seqs=2, max_num_tokens=16, chunk=8,
                    max_length=max_length, eos_id=EOS, vocab_size=V)
  assert sched.add([4, 5, 6], SamplingParams(max_tokens=29)).params.max_tokens == 29  # 32 tokens: fits exactly
  with pytest.raises(RequestError) as e:
    sched.add([4, 5, 6], SamplingParams(max_tokens=30))
  assert e.value.field == "max_tokens" and why in str(e.value), e.value


def test_budgets_must_allow_a_token_per_sequence():
  with pytest.raises(ValueError, match="serve_max_num_tokens"):
    Scheduler(PageAllocator(8, page_size=4), max_num_seqs=8, max_num_tokens=4, chunk=4, max_length=32,
              eos_id=EOS, vocab_size=V)


def test_a_waiting_head_counts_its_prefix_lookup_once_and_finished_requests_drain():
  sched = Scheduler(PageAllocator(6, page_size=4), max_num_seqs=4, max_num_tokens=64, chunk=64, max_length=32,
                    eos_id=None, vocab_size=V)
  prompt = list(range(3, 14))  # 11 tokens: 2 full pages, 3 pages in all
  run(sched, {0: [(prompt, SamplingParams(max_tokens=1))]})  # its 2 full pages stay cached
  assert [r.id for r in sched.take_finished()] == [0] and sched.finished == [] and sched.take_finished() == []
  lookups = sched.allocator.lookups
  hog = sched.add([40] * 12, SamplingParams(max_tokens=8))  # 3 pages, then a 4th and 5th as it decodes
  sched.update(sched.schedule(), [5])
  head = sched.add(prompt + [20], SamplingParams(max_tokens=1))  # shares 2 pages, needs 2 more: only 1 left
  for _ in range(3):  # the head waits for pages step after step
    rows = sched.schedule()
    assert [r.request for r in rows] == [hog]
    sched.update(rows, [5])
  assert head in sched.waiting
  assert sched.allocator.lookups == lookups + 2 + 2  # the hog's 2 full pages looked up, the head's 2 once
  sched.abort(hog)
  run(sched, {0: []})
  assert head.finish_reason == "length" and sched.allocator.lookups == lookups + 4
  assert [r.id for r in sched.take_finished()] == [hog.id, head.id]
