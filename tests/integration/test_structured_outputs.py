"""Structured outputs in the serving engine (MaxText/inference/grammar.py): random weights sampled at
temperature 1 (an adversarial sampler), many seeds batched together: every JSON-schema output parses
and validates, every regex output matches whole, every choice output is a choice, each ends "stop";
the unconstrained rows beside them (more than 10 steps shared) make the same tokens as without them
(same seeds); max_tokens cutting a grammar ends it with "length"."""

import json
import os
import re

import pytest

from MaxText.checkpoint import model_state
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import Grammars, GrammarSpec
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT, make_config
from tests.support.serving import BASE  # the serving tests' tiny engine

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # at most 22 characters: closes within max_tokens
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe"]
SPECS = [GrammarSpec("json", json.dumps(SCHEMA)), GrammarSpec("regex", REGEX, "structured_outputs"),
         GrammarSpec("choice", json.dumps(CHOICES), "structured_outputs")]
N = 36  # constrained requests, 12 of each kind, with 12 unconstrained ones among them
MAX_TOKENS = 30


def _valid(kind: str, text: str) -> bool:
  if kind == "regex":
    return re.fullmatch(REGEX, text) is not None
  if kind == "choice":
    return text in CHOICES
  obj = json.loads(text)  # raises on invalid JSON: the test fails naming it
  return (set(obj) == {"n", "ok"} and type(obj["n"]) is int and 0 <= obj["n"] <= 99 and type(obj["ok"]) is bool)


@pytest.fixture(scope="module")
def served():
  """(engine, tokenizer, the batch's requests and params): N constrained and N/3 free requests at temperature 1."""
  cfg = make_config(**{**BASE, "serve_max_num_seqs": 2})  # few programs (BASE: one width, one context bucket)
  tok = load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=TOKENIZER))
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=tok.eos_id, grammars=Grammars.for_tokenizer(tok, 512))
  prompts = [tok.encode(p) for p in ("A", "I", "The")]  # one token each: every step is [rows, 1] (few programs)
  assert all(len(p) == 1 for p in prompts)
  plist = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=SPECS[i % 3] if i % 4 else None)
           for i in range(N + N // 3)]
  for spec in SPECS:  # compiled first (as the server does): each request queues in its arrival order
    eng.grammars.compile(spec).result()
  requests = [eng.add_request(prompts[i % 3], p) for i, p in enumerate(plist)]
  shared = 0  # steps where a free row made a token beside a constrained one
  while not eng.idle:
    kinds = {r.params.grammar is None for r, _ in eng.step()}
    shared += kinds == {True, False}
  assert shared > 10, shared
  return eng, tok, prompts, requests, plist


def test_constrained_outputs_at_temperature_1_always_match_their_grammar(served):
  eng, tok, _, requests, plist = served
  kinds = [(r, p.grammar.kind) for r, p in zip(requests, plist) if p.grammar is not None]
  assert len(kinds) == N
  for r, kind in kinds:
    text = tok.decode(r.output)
    assert r.finish_reason == "stop" and _valid(kind, text), (kind, text, r.finish_reason)
  assert eng.idle and not eng.held.requests and eng.allocator.used_pages == 0


def test_unconstrained_rows_make_the_same_tokens_without_their_constrained_neighbours(served):
  eng, _, prompts, requests, plist = served
  free = [i for i, p in enumerate(plist) if p.grammar is None]
  alone = eng.generate([prompts[i % 3] for i in free], [plist[i] for i in free])
  assert [r.output for r in alone] == [requests[i].output for i in free]
  assert all(r.finish_reason == requests[i].finish_reason for r, i in zip(alone, free))


def test_max_tokens_cutting_a_grammar_ends_with_length(served):
  eng, tok, prompts, _, _ = served
  (r,) = eng.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=1.0, seed=5, grammar=SPECS[0]))
  text = tok.decode(r.output)
  assert r.finish_reason == "length" and len(r.output) == 3 and text.startswith("{")
  with pytest.raises(json.JSONDecodeError):
    json.loads(text)


def test_a_constrained_rows_logprobs_are_the_models_before_the_mask(served):
  """docs/logprobs.md: the grammar changes what is drawn, never what is reported (vLLM reports the masked
  distribution): at the same position the constrained row's top logprobs are the free row's."""
  eng, tok, prompts, _, _ = served
  free, held = eng.generate([prompts[0]] * 2, [SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
                                               SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, grammar=SPECS[2])])
  p = len(prompts[0])
  assert any(not any(c.startswith(tok.decode([i])) for c in CHOICES) for i, _ in free.logprobs[p].top)  # not all allowed
  assert held.logprobs[p].top == free.logprobs[p].top and any(c.startswith(tok.decode(held.output)) for c in CHOICES)
