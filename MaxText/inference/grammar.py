"""Structured outputs in the serving engine: a request's grammar (a JSON schema, any JSON object, a
regex, a choice of strings) as an llguidance matcher, the step's packed token bitmask, and the worker
that compiles grammars off the step loop.

    grammars = Grammars.for_tokenizer(tokenizer, vocab_size=config.vocab_size)   # None: not a tokenizer.json
    engine = ServingEngine(config, graphdef, params, buffers, grammars=grammars)
    engine.add_request(prompt, SamplingParams(temperature=1.0, grammar=GrammarSpec("json", schema_text, field)))

Library: llguidance (Microsoft's guidance engine in Rust, a numpy bitmask API, tokenizers from a
tokenizer.json string: no transformers at run time, no torch). xgrammar, the other engine vLLM and
SGLang use, fills its bitmask into torch tensors, and torch is test-only here.

A request's life (serving.py):
  1. add_request: `Grammars.compile(spec)` hands the grammar to a worker thread (a future; one compile
     per distinct grammar, cached) and the request is held out of the scheduler's queue (Scheduler.add
     hold=True) while it compiles: other requests keep stepping. Each step starts by queueing the held
     requests whose grammar is ready (each gets its own matcher, a cheap copy of the compiled one); a
     grammar that fails ends its request ("abort"). The server compiles (awaits) before it submits, so
     a bad schema is its 400 and the engine's future is already done.
  2. a step holding a sampling row with a grammar fills `mask` [B, ceil(V/32)] int32 on the host (bit j
     of word w allows token 32w + j; llguidance fills the rows in parallel), rows without one all ones,
     and runs the step program's masked variant (a separate compiled variant, as the logprob step; a step
     without a constrained row runs the unchanged program). `apply_bitmask` sets the disallowed logits
     to -inf before temperature, top_p and top_k. The stop tokens (EOS unless ignore_eos, stop_token_ids)
     are allowed exactly when the grammar accepts what is generated so far (is_accepting).
  3. after the step each constrained row's new token advances its matcher (`advance`); a matcher that
     can take nothing more (the grammar is complete: the closing brace of the top-level object) ends
     its request with finish_reason "stop" at once. max_tokens still applies: a grammar cut by it ends
     with finish_reason "length" and its text is a prefix of a valid output, not a valid one.
JSON is generated in json.dumps' default layout, ", " and ": " and no other whitespace (JSON_LAYOUT; a
schema's own "x-guidance" overrides it): a random or weak model cannot pad forever with whitespace.
Logprobs stay the model's own (logprobs.py): the mask changes what is drawn, not what is reported.
With speculative decoding a constrained row drafts nothing (step_spec.py): its step verifies no draft
and draws one token from the masked target, so each token is checked against the grammar before it is taken.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.runtime.cli import FieldError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' layout
KINDS = ("json", "regex", "choice", "lark")
_CACHED = 256  # compiled grammars kept (least recently used dropped)


class GrammarError(FieldError):
  """A grammar that cannot be compiled; `field` names the request field it came from (a 400)."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
  """A request's grammar: kind "json" (source: a JSON schema's text), "regex" (a regex matched whole),
  "choice" (a JSON list of strings) or "lark" (llguidance's Lark syntax: the server's own grammars, such
  as server/tool_grammar.py's); field: the request field it came from (errors name it)."""
  kind: str
  source: str
  field: str = "response_format"


def llg_grammar(spec: GrammarSpec) -> str:
  """The llguidance grammar of a spec (not yet checked: compiling a matcher does that). A boolean schema
  is JSON Schema's: true is any JSON value (the schema {}), false matches nothing (a GrammarError)."""
  import llguidance as llg
  if spec.kind == "json":
    try:
      schema = json.loads(spec.source)
    except ValueError as e:
      raise GrammarError(f"{spec.field}: the JSON schema is not JSON: {e}", spec.field) from None
    if schema is False:
      raise GrammarError(f"{spec.field}: the JSON schema false matches no value: give an object schema, or true for "
                         "any JSON value", spec.field)
    if not isinstance(schema, (dict, bool)):
      raise GrammarError(f"{spec.field}: a JSON schema is an object (or true), not {type(schema).__name__}", spec.field)
    return llg.LLMatcher.grammar_from_json_schema(json.dumps({} if schema is True else schema), defaults=JSON_LAYOUT)
  if spec.kind == "regex":
    return llg.LLMatcher.grammar_from_regex(spec.source)
  if spec.kind == "choice":
    choices = json.loads(spec.source)
    if not choices or not all(isinstance(c, str) and c for c in choices):
      raise GrammarError(f"{spec.field}: choice is a non-empty list of non-empty strings", spec.field)
    return llg.grammar_from("choice", choices)
  if spec.kind == "lark":
    return llg.grammar_from("lark", spec.source)
  raise GrammarError(f"{spec.field}: grammar kind {spec.kind!r} is not one of {KINDS}", spec.field)


class Constraint:
  """One request's grammar: its compile (a future of the compiled matcher), then its own matcher."""

  def __init__(self, future: concurrent.futures.Future):
    self.future, self.matcher = future, None

  def start(self) -> None:
    """The request's own matcher from the compiled one (raises GrammarError when the compile failed)."""
    self.matcher = self.future.result().deep_copy()


class Grammars:
  """The server's grammar side: llguidance's tokenizer, the compile worker and its cache, the mask fill."""

  def __init__(self, tokenizer_json: str, *, eos_id: int, vocab_size: int, workers: int = 1):
    """tokenizer_json: a tokenizer.json's text, eos_id its EOS; vocab_size: the model's (the logits' width V,
    at least the tokenizer's)."""
    import llguidance as llg
    self.tokenizer = llg.LLTokenizer(tokenizer_json, eos_token=eos_id)
    self.vocab_size = vocab_size
    self.words = -(-vocab_size // 32)  # the mask's int32 words a row: [B, ceil(V/32)]
    self._llg_words = -(-self.tokenizer.vocab_size // 32)  # llguidance's own row (its tokenizer's vocabulary)
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
    self._executor = llg.LLExecutor(min(4, os.cpu_count() or 1))
    self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
    self._lock = threading.Lock()  # compile() is called by the server's event loop and the engine thread

  @classmethod
  def for_tokenizer(cls, tokenizer, vocab_size: int) -> "Grammars | None":
    """From a data.tokenizer Tokenizer: a Hugging Face tokenizer.json (its file's text); None for another kind."""
    path = getattr(tokenizer, "path", "")
    if tokenizer is None or not path.endswith(".json"):
      return None
    with open(path, encoding="utf-8") as f:
      return cls(f.read(), eos_id=tokenizer.eos_id, vocab_size=vocab_size)

  def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
    """A future of the spec's compiled matcher (GrammarError when it fails), compiled on the worker once
    per distinct spec."""
    with self._lock:
      future = self._cache.pop(spec, None) or self._pool.submit(self._build, spec)
      self._cache[spec] = future
      while len(self._cache) > _CACHED:
        self._cache.popitem(last=False)
      return future

  def _build(self, spec: GrammarSpec):
    """The compiled matcher; whatever fails while compiling is a GrammarError naming the field (a 400, never a 500)."""
    import llguidance as llg
    try:
      matcher = llg.LLMatcher(self.tokenizer, llg_grammar(spec), log_level=0)
    except GrammarError:
      raise
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError, RuntimeError, ... for what it refuses
      raise GrammarError(f"{spec.field}: the grammar does not compile: {e}", spec.field) from None
    if matcher.is_error():
      raise GrammarError(f"{spec.field}: {matcher.get_error()}", spec.field)
    return matcher

  def mask(self, rows: Sequence, where: Sequence[int], b: int, eos_id: int | None) -> np.ndarray | None:
    """The step's bitmask [b, ceil(V/32)] int32 for Scheduled rows at batch rows `where`: a sampling row
    with a grammar gets its matcher's allowed tokens, its stop tokens (the engine's eos_id unless
    ignore_eos, stop_token_ids) only while the grammar accepts; every other row all ones. None when no
    sampling row has a grammar (the plain program runs)."""
    import llguidance.numpy as lln
    held = [(row.request, i) for row, i in zip(rows, where) if row.samples and row.request.constraint is not None]
    if not held:
      return None
    allowed = np.zeros((b, self._llg_words), np.int32)  # llguidance's rows: its tokenizer's vocabulary
    lln.fill_next_token_bitmask_par(self._executor, [(r.constraint.matcher, i) for r, i in held], allowed)
    mask = np.full((b, self.words), -1, np.int32)
    bits = mask.view(np.uint32)
    n = min(self.words, self._llg_words)
    for r, i in held:
      mask[i] = 0
      mask[i, :n] = allowed[i, :n]
      _set_bit(bits[i], self.tokenizer.eos_token, False)  # llguidance's EOS stands for the request's stop tokens:
      if r.constraint.matcher.is_accepting():
        p = r.params
        for tok in (*p.stop_token_ids, *(() if p.ignore_eos or eos_id is None else (eos_id,))):
          _set_bit(bits[i], tok, tok < self.vocab_size)
    return mask


class Held:
  """The engine's requests held out of the scheduler's queue while their grammars compile."""

  def __init__(self):
    self.requests: list = []

  def add(self, request, future: concurrent.futures.Future) -> None:
    request.constraint = Constraint(future)
    self.requests.append(request)

  def release(self, scheduler) -> None:
    """Queues each held request whose grammar is compiled (its own matcher made); one whose grammar failed
    ends ("abort"); an aborted one is dropped."""
    keep = []
    for r in self.requests:
      if r.finish_reason is not None:
        continue
      if not r.constraint.future.done():
        keep.append(r)
        continue
      try:
        r.constraint.start()
      except Exception:  # noqa: BLE001 - a grammar that fails to compile ends its own request only
        scheduler.abort(r)
        continue
      scheduler.enqueue(r)
    self.requests = keep

  def wait(self, timeout: float) -> None:
    """Up to `timeout` seconds for a held grammar to finish compiling (a step with nothing else to run)."""
    concurrent.futures.wait([r.constraint.future for r in self.requests], timeout,
                            concurrent.futures.FIRST_COMPLETED)


def _set_bit(words: np.ndarray, token: int, value: bool) -> None:
  """Sets (or clears) token's bit in one row of uint32 words; ids outside the row are ignored."""
  if 0 <= token < 32 * len(words):
    bit = np.uint32(1 << (token % 32))
    words[token // 32] = words[token // 32] | bit if value else words[token // 32] & ~bit


def advance(rows: Sequence, made: Sequence[int | None]) -> list:
  """After scheduler.update: each constrained row's new tokens (its output past made[i]) advance its
  matcher -> the still running requests whose grammar is now complete (or broken): end them ("stop")."""
  done = []
  for row, n in zip(rows, made):
    r = row.request
    if n is None or r.constraint is None:
      continue
    for tok in r.output[n:]:
      r.constraint.matcher.consume_token(tok)
    if r.finish_reason is None and r.constraint.matcher.is_stopped():
      done.append(r)
  return done


def apply_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """logits [B,...,V], mask [B,W] int32 (bit j of word w allows token 32w + j; W*32 >= V) -> logits with the
  disallowed ids at -inf."""
  b, v = logits.shape[0], logits.shape[-1]
  bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B,W,32] (arithmetic shift: & 1 keeps the bit)
  allowed = bits.reshape(b, -1)[:, :v] > 0  # [B,V]
  allowed = allowed.reshape((b,) + (1,) * (logits.ndim - 2) + (v,))  # [B,1..,V]
  return jnp.where(allowed, logits, -jnp.inf)


__all__ = ["GrammarSpec", "GrammarError", "Grammars", "Constraint", "Held", "llg_grammar", "advance", "apply_bitmask",
           "JSON_LAYOUT"]
