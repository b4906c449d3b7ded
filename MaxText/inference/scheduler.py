"""Continuous batching on the host: which requests run in the next step, and how many tokens each.

A request's sequence is its prompt, then the tokens generated so far. `computed` counts the
leading tokens whose cache entries are written; a step computes the next ones. Each step
(`schedule`) picks, under two budgets, `max_num_seqs` sequences and `max_num_tokens` tokens:
  1. every running request, oldest first: a decoding one (all but its newest token computed)
     takes 1 token, a prefilling one the next chunk of its prompt (at most `chunk` tokens);
  2. then waiting requests, first come first served, while a sequence slot, tokens and pages
     are left: each first takes the cached pages of its longest cached prompt prefix (page
     allocator's `match`; at least its last prompt token is always computed, for its logits).
  3. a step is either narrow (every row computes 1 token: decode rows, and a prompt's last token)
     or wide (prefill chunks; a decode row with drafts is narrow): the engine pads every row of a step to its widest row (serving.py:
     [rows, 1] or [rows, chunk]), so a decode row in a wide step would cost a whole chunk. When
     both kinds are ready, steps alternate: the narrow rows, then the wide ones, then the narrow.
With speculative decoding (`speculative` k > 0) a decoding request's row is its newest token then
its drafts (Request.drafts, at most k, made by the engine's MTP pass; none past max_tokens or the
context): 1 + k tokens of the budget and pages for every draft position. While a running request
has a row to come, the tokens its row needs are kept out of earlier prefill chunks, so a decode
row always gets its drafts (serve_max_num_tokens >= serve_max_num_seqs * (1 + k) is required).
Every token computed needs its page: when the allocator runs out, the NEWEST running request
is preempted (its pages released, `computed` reset to 0; it waits at the head of the queue and
recomputes its prompt and generated tokens when readmitted: greedy output does not change).
`update` takes the step's sampled tokens (a row with drafts: the accepted drafts then the target's
token; only entries of accepted positions count as computed, a rejected draft's are overwritten
later and never published; a stop token or max_tokens inside the run ends it there): a page a
step fills is published to the prefix cache at once (running requests share it too); a request whose every known token is now computed
gets its next token; it finishes on a stop token (EOS unless ignore_eos, or one of
stop_token_ids; one of stop_string_ids only from its min_tokens + 1-th token on), at max_tokens, or when its sequence fills max_length; one that has run past its
params.timeout since its arrival ends ("timeout") when the next step is scheduled. A finished request
publishes its full pages to the prefix cache and releases them at once.

With a sharded allocator (decode on a mesh: D page shards, one per group of devices holding rows)
a request lives on one shard, its home, for as long as it holds pages: all its pages come from
that shard, at most max_num_seqs / D running requests share a shard (so each device's rows fit the
step's [max_num_seqs / D] rows), a new request goes to the open shard with the most free pages
(or the shard of its cached prefix, when that one is open), and a preemption takes the newest
running request of the same shard.

Invariants (tests/unit/test_scheduler.py): no request is lost, duplicated or stuck; a step never
exceeds either budget; after every request finishes, every page is free or cached.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Sequence

from MaxText.inference.page_allocator import OutOfPages, PageAllocator
from MaxText.runtime.cli import FieldError


class RequestError(FieldError):
  """A request the engine cannot serve; the message names the field (an OpenAI 400)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per request, OpenAI's names. temperature 0 = greedy; top_k 0 and top_p 1 = off."""
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  stop_token_ids: tuple[int, ...] = ()
  stop_string_ids: tuple[int, ...] = ()  # those of stop_token_ids that are single-token stop strings: they
  # end the output only from its min_tokens + 1-th token on and are never banned by min_tokens (vLLM's stop strings)
  ignore_eos: bool = False
  seed: int | None = None
  logprobs: int | None = None  # each generated token's logprob and the top N (inference/logprobs.py); None = off
  prompt_logprobs: int | None = None  # every prompt token's logprob and the top N; None = off
  rollout: bool = False  # record per token what RL's loss needs (inference/rollout.py) in Request.rollout
  grammar: Any = None  # structured outputs: a grammar.GrammarSpec the output must match; None = free
  # Before the kept set, vLLM's definitions (inference/penalties.py); the defaults change nothing:
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
  min_p: float = 0.0
  min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
  timeout: float = 0.0  # seconds the request may take from its arrival (serve_request_timeout); 0 = no limit
  lora_adapter: int = 0  # the served LoRA adapter: serve_lora_adapters' k-th entry (1-based); 0 = the base model
  cache_salt: str = ""  # vLLM's: only requests with the same salt (and adapter) share prefix-cached pages

  def check(self, vocab_size: int) -> None:
    """Raises RequestError naming the first bad field."""
    bad = [("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
           ("temperature", 0.0 <= self.temperature <= 100.0, "a number in [0, 100]"),
           ("top_p", 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
           ("top_k", self.top_k >= 0, "an integer >= 0 (0 = off)"),
           ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids),
            f"token ids in [0, {vocab_size})"),
           ("stop_string_ids", set(self.stop_string_ids) <= set(self.stop_token_ids), "a subset of stop_token_ids"),
           ("seed", self.seed is None or 0 <= self.seed < 2 ** 63, "an integer in [0, 2**63)"),
           ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "a number in [-2, 2]"),
           ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "a number in [-2, 2]"),
           ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0, "a number in (0, 100] (1 = off)"),
           ("logit_bias", all(0 <= t < vocab_size and -100 <= b <= 100 for t, b in self.logit_bias),
            f"token ids in [0, {vocab_size}) mapped to numbers in [-100, 100]"),
           ("min_p", 0.0 <= self.min_p <= 1.0, "a number in [0, 1] (0 = off)"),
           ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"),
           ("timeout", self.timeout >= 0, "a number of seconds >= 0 (0 = no limit)")]
    for field, ok, want in bad:
      if not ok:
        raise RequestError(f"{field}={getattr(self, field)!r} is invalid: expected {want}", field)


@dataclasses.dataclass(eq=False)
class Request:
  prompt: list[int]
  params: SamplingParams
  id: int = -1
  arrival: float = dataclasses.field(default_factory=time.monotonic)
  output: list[int] = dataclasses.field(default_factory=list)
  computed: int = 0  # leading tokens of prompt + output whose cache entries are written
  pages: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
  preemptions: int = 0
  first_token_time: float | None = None
  drafts: list[int] = dataclasses.field(default_factory=list)  # speculative: tokens to verify next step
  draft_row: int = 0  # speculative: its row of the engine's drafts' distributions (kept while it runs)
  logprobs: dict = dataclasses.field(default_factory=dict)  # position -> logprobs.Logprob (when asked)
  rollout: object = None  # rollout.Rollout for a request with params.rollout (the engine fills it)
  constraint: Any = None  # its grammar's compile and matcher (grammar.Constraint), when params.grammar is set

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def prefix_root(self) -> bytes:
    """Where its pages' prefix keys start (page_allocator.page_hashes): its LoRA adapter's and its cache_salt's,
    so requests through different adapters (or none), or with different salts, never share cached pages."""
    p = self.params
    root = b"" if not p.lora_adapter else f"lora:{p.lora_adapter}".encode()
    return root if not p.cache_salt else root + b"salt:" + p.cache_salt.encode()

  @property
  def prefilling(self) -> bool:
    return self.computed < len(self.prompt)


@dataclasses.dataclass
class Scheduled:
  """One row of a step: compute tokens [start, start + count) of request's sequence, the last
  len(drafts) of them its drafts (past the sequence's known tokens)."""
  request: Request
  start: int
  count: int
  drafts: tuple[int, ...] = ()

  @property
  def known(self) -> int:
    """The row's tokens from the request's sequence (the drafts follow)."""
    return self.count - len(self.drafts)

  @property
  def samples(self) -> bool:
    """Whether this row's logits at its last known token give the request its next token(s)."""
    return self.start + self.known == len(self.request.tokens)

  @property
  def is_wide(self) -> bool:
    """A prefill chunk (more than one known token); a decode row, drafts or not, is narrow."""
    return self.known > 1


class Scheduler:
  def __init__(self, allocator: PageAllocator, *, max_num_seqs: int, max_num_tokens: int, chunk: int,
               max_length: int, eos_id: int | None, vocab_size: int, speculative: int = 0):
    if max_num_tokens < max_num_seqs * (1 + speculative):
      raise ValueError(f"serve_max_num_tokens={max_num_tokens} must be >= serve_max_num_seqs={max_num_seqs} x "
                       f"(1 + serve_speculative_tokens={speculative}): every running sequence takes 1 + "
                       "serve_speculative_tokens tokens per step")
    self.speculative = speculative
    self.allocator = allocator
    self.max_num_seqs, self.max_num_tokens, self.chunk = max_num_seqs, max_num_tokens, chunk
    self.max_length, self.eos_id, self.vocab_size = max_length, eos_id, vocab_size
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # oldest admission first
    self._ids = itertools.count()
    self.finished: list[Request] = []  # since the last take_finished()
    self._looked_up: Request | None = None  # the queue head whose prefix lookup is already counted
    self._wide = False  # whether the last step ran prefill chunks (rule 3)
    # rollouts (inference/rollout.py): (prompt, cached pages) -> how many of them a rollout may share
    self.rollout_shareable = lambda prompt, pages: pages
    # on_finish(request): called as a request finishes, its pages still held (tests read where it wrote)
    self.on_finish = None

  # ---- requests
  def add(self, prompt: Sequence[int], params: SamplingParams, hold: bool = False) -> Request:
    """Queues a request; raises RequestError (naming the field) for one that can never run. hold: checked
    and made, not queued yet (its grammar compiles): `enqueue` queues it."""
    params.check(self.vocab_size)
    if not prompt:
      raise RequestError("prompt has no tokens", "prompt")
    bad = [int(t) for t in prompt if not 0 <= int(t) < self.vocab_size]
    if bad:
      raise RequestError(f"prompt has token ids {bad[:5]} outside [0, {self.vocab_size})", "prompt")
    if len(prompt) + params.max_tokens > self.max_length:
      raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) is more than the "
                         f"context length {self.max_length}", "max_tokens")
    if self.allocator.pages_for(len(prompt) + params.max_tokens) > self.allocator.shard_pages:
      raise RequestError(f"prompt + max_tokens needs more pages than the whole pool "
                         f"({self.allocator.shard_pages} of {self.allocator.page_size} tokens"
                         f"{' per shard' if self.allocator.shards > 1 else ''})", "max_tokens")
    r = Request([int(t) for t in prompt], params, id=next(self._ids))
    if not hold:
      self.waiting.append(r)
    return r

  def enqueue(self, r: Request) -> None:
    """Queues a request made with add(hold=True) (at the back: first come first served from now)."""
    if r.finish_reason is None:
      self.waiting.append(r)

  def abort(self, request: Request, reason: str = "abort") -> None:
    """Ends a request now (a client went away; reason "stop": its grammar is complete): its pages go back
    at once."""
    if request.finish_reason is not None:
      return
    if request in self.running:
      self.running.remove(request)
    elif request in self.waiting:
      self.waiting.remove(request)
    self._finish(request, reason)

  @property
  def idle(self) -> bool:
    return not self.running and not self.waiting

  def take_finished(self) -> list[Request]:
    """The requests finished since the last call, oldest first; forgets them (a long-running server
    calls this so `finished` stays bounded)."""
    done, self.finished = self.finished, []
    return done

  # ---- one step
  def schedule(self) -> list[Scheduled]:
    """The next step's rows, running requests first (oldest first), then admitted waiting ones. Requests
    past their params.timeout end first ("timeout", pages back at once), running or waiting."""
    self._expire(time.monotonic())
    rows, budget = [], self.max_num_tokens
    for r in list(self.running):  # oldest first: a preemption only ever takes a newer, unscheduled one
      if r not in self.running:
        continue
      later = sum(1 + len(self._drafts(o)) for o in self.running[self.running.index(r) + 1:]
                  if o.computed == len(o.tokens) - 1) if self.speculative else 0  # kept for later decode rows
      n = min(self.chunk, len(r.tokens) - r.computed, budget - later)  # 1 when decoding
      drafts = self._drafts(r)[:max(0, budget - n)] if r.computed == len(r.tokens) - 1 else ()
      if n <= 0 or not self._make_room(r, r.computed + n + len(drafts)):
        continue
      rows.append(Scheduled(r, r.computed, n + len(drafts), drafts))
      budget -= n + len(drafts)
    while self.waiting and self._open_shards() and budget > 0:
      r = self.waiting[0]
      self._share_prefix(r)
      n = min(self.chunk, len(r.tokens) - r.computed, budget)
      if not self._take_pages(r, r.computed + n):
        self.allocator.release(r.pages)  # a waiting request holds no pages
        r.pages, r.computed = [], 0
        break  # it stays at the head of the queue until pages come back
      self.waiting.popleft()
      self._looked_up = None
      self.running.append(r)
      rows.append(Scheduled(r, r.computed, n))
      budget -= n
    wide = [row for row in rows if row.is_wide]
    if wide and len(wide) < len(rows):  # both kinds: the kind the last step did not run (rule 3)
      rows = [row for row in rows if row.is_wide != self._wide]
    self._wide = bool(rows) and rows[0].is_wide
    return rows

  def update(self, rows: Sequence[Scheduled], sampled: Sequence) -> list[Request]:
    """sampled[i]: the token drawn from row i's logits at its last known token, or (a row with
    drafts) the run of tokens it verified: its accepted drafts, then the target's token (ignored
    where not rows[i].samples). Returns the requests that finished in this step."""
    done = []
    now = time.monotonic()
    page = self.allocator.page_size
    for row, run in zip(rows, sampled):
      r = row.request
      run = [int(t) for t in (run if isinstance(run, (list, tuple)) else [run])]
      if row.drafts and (len(run) > len(row.drafts) + 1 or run[:-1] != list(row.drafts[:len(run) - 1])):
        raise ValueError(f"a verified run {run} does not start with the row's drafts {row.drafts}")
      r.computed = row.start + row.known + (len(run) - 1 if row.samples else 0)  # accepted drafts count
      r.drafts = []
      reason = None
      if row.samples:
        if r.first_token_time is None:
          r.first_token_time = now
        for tok in run:
          stop = _stops(r.params, tok, len(r.output), self.eos_id)
          if not stop:
            r.output.append(tok)
          reason = "stop" if stop else ("length" if len(r.output) >= r.params.max_tokens
                                        or len(r.tokens) >= self.max_length else None)
          if reason:
            break
        r.computed = min(r.computed, len(r.tokens))  # a run cut short: its later entries do not count
      if r.computed // page > row.start // page:  # a page filled: later prompts may share it now
        self.allocator.publish(r.pages, r.tokens[:r.computed], r.prefix_root)
      if reason:
        self.running.remove(r)
        self._finish(r, reason)
        done.append(r)
    return done

  def _expire(self, now: float) -> None:
    """Ends every request that has run longer than its params.timeout since its arrival ("timeout")."""
    for r in [*self.running, *self.waiting]:
      if r.params.timeout and now - r.arrival > r.params.timeout:
        self.abort(r, "timeout")

  def _drafts(self, r: Request) -> tuple[int, ...]:
    """A decoding request's drafts to verify: at most `speculative`, none past max_tokens or the context."""
    room = min(r.params.max_tokens - len(r.output), self.max_length - len(r.tokens)) - 1
    return tuple(r.drafts[:max(0, min(self.speculative, room))])

  # ---- pages
  def _home(self, r: Request) -> int | None:
    """The shard of r's pages (None: it holds none)."""
    return self.allocator.shard_of(r.pages[0]) if r.pages else None

  def _open_shards(self) -> list[int]:
    """Shards with a sequence slot left (max_num_seqs / shards each)."""
    shards = self.allocator.shards
    count = collections.Counter(self._home(r) for r in self.running)
    return [s for s in range(shards) if count[s] < self.max_num_seqs // shards]

  def _share_prefix(self, r: Request) -> None:
    """Points a new request's first pages at the cached pages of its prompt's longest cached prefix,
    keeping at least its last prompt token to compute (none when that prefix's shard is full). A head
    of the queue retried step after step (waiting for pages) counts as one lookup in the hit rate.
    With speculative decoding the last matched page is recomputed too: the MTP entry at a page's last
    position depends on the NEXT token, which the page's key does not hold (vLLM drops it alike).
    A request asking for prompt_logprobs takes no cached pages; a rollout, only those whose routing
    the engine kept (rollout.py)."""
    pages = self.allocator.match(r.prompt[:len(r.prompt) - 1], count=r is not self._looked_up, root=r.prefix_root)
    if r.params.prompt_logprobs is not None:
      pages = []  # every prompt position's logits are needed: recompute the whole prompt (logprobs.py)
    if r.params.rollout:
      pages = pages[:self.rollout_shareable(r.prompt, len(pages))]  # only pages whose routing is kept
    self._looked_up = r
    if self.speculative and pages:
      pages = pages[:-1]
    if pages and self.allocator.shard_of(pages[0]) not in self._open_shards():
      pages = []
    self.allocator.share(pages)
    r.pages, r.computed = pages, len(pages) * self.allocator.page_size

  def _take_pages(self, r: Request, upto: int) -> bool:
    """Pages for r's positions < upto; False (nothing taken) when the pool cannot give them."""
    need = self.allocator.pages_for(upto) - len(r.pages)
    if need <= 0:
      return True
    shard = self._home(r)
    if shard is None:  # a new request: the open shard with the most free pages
      shard = max(self._open_shards(), key=self.allocator.free_in)
    try:
      r.pages += self.allocator.allocate(need, shard)
    except OutOfPages:
      return False
    return True

  def _make_room(self, r: Request, upto: int) -> bool:
    """Pages for a running request, preempting the newest running requests of its shard (never r
    itself unless it is the newest) until they fit."""
    while not self._take_pages(r, upto):
      victim = [v for v in self.running if v is r or self._home(v) == self._home(r)][-1]
      self._preempt(victim)
      if victim is r:
        return False
    return True

  def _preempt(self, r: Request) -> None:
    self.running.remove(r)
    self.allocator.release(r.pages)
    r.pages, r.computed, r.drafts = [], 0, []
    r.preemptions += 1
    self.waiting.appendleft(r)

  def _finish(self, r: Request, reason: str) -> None:
    r.finish_reason = reason
    if self.on_finish is not None:
      self.on_finish(r)
    written = r.tokens[:r.computed]  # tokens whose entries are in its pages
    self.allocator.publish(r.pages, written, r.prefix_root)
    self.allocator.release(r.pages)
    r.pages = []
    self.finished.append(r)


def _stops(params: SamplingParams, tok: int, made: int, eos_id: int | None) -> bool:
  """Whether token `tok`, made after `made` output tokens, ends the output (and is dropped from it)."""
  if tok in params.stop_string_ids:
    return made >= params.min_tokens  # a stop string counts from the min_tokens + 1-th token on (vLLM's)
  return tok in params.stop_token_ids or (not params.ignore_eos and tok == eos_id)


__all__ = ["Scheduler", "Request", "Scheduled", "SamplingParams", "RequestError"]
