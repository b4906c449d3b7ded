"""Structured outputs without a model (MaxText/inference/grammar.py, MaxText/server/structured.py): the
packed bitmask keeps exactly its allowed ids (against numpy's bit order); a constrained row's mask allows
what its grammar allows and its stop tokens only while the grammar accepts, other rows everything;
OpenAI's response_format and vLLM's structured_outputs / guided_* become one grammar, malformed ones a 400
naming the field; a bad schema or regex is a 400 with OpenAI's body before anything reaches the engine."""

import contextlib
import json
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient

from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import Constraint, Grammars, GrammarSpec, advance, apply_bitmask
from MaxText.inference.scheduler import SamplingParams
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.protocol import ApiError, ChatRequest, CompletionRequest, Texts
from MaxText.server.structured import grammar_spec
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import ScriptedEngine

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
V = 512  # the tiny model's vocabulary; the tokenizer's is 391


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=TOKENIZER))


@pytest.fixture(scope="module")
def grammars(tok):
  return Grammars.for_tokenizer(tok, V)


def test_apply_bitmask_keeps_exactly_the_allowed_ids():
  rng = np.random.default_rng(0)
  v = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
  mask = rng.integers(-2 ** 31, 2 ** 31, (3, 3), dtype=np.int64).astype(np.int32)  # [B, ceil(V/32)]
  logits = rng.normal(size=(3, 2, v)).astype(np.float32)  # [B, m, V]: every position of a row masked alike
  want = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)  # id 32w + j = word w, bit j
  got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
  np.testing.assert_array_equal(np.isfinite(got), np.broadcast_to(want[:, None], got.shape))
  np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(got)])


def _row(tok_ids, spec, grammars, **params):
  """A Scheduled-like sampling row whose request has consumed tok_ids under spec's grammar."""
  r = types.SimpleNamespace(params=SamplingParams(grammar=spec, **params), output=[], finish_reason=None)
  r.constraint = Constraint(grammars.compile(spec))
  r.constraint.start()
  row = types.SimpleNamespace(request=r, samples=True)
  r.output += tok_ids
  assert advance([row], [0]) == ([r] if r.constraint.matcher.is_stopped() else [])
  return row


def _allowed(mask_row) -> set[int]:
  return set(np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")).tolist())


def test_mask_allows_the_grammar_and_stop_tokens_only_while_it_accepts(grammars, tok):
  spec = GrammarSpec("regex", "ab+", "structured_outputs")
  a, b = tok.encode("a"), tok.encode("b")
  fresh, accepting = _row([], spec, grammars, stop_token_ids=(7,)), _row(a + b, spec, grammars, stop_token_ids=(7,))
  free = types.SimpleNamespace(request=types.SimpleNamespace(constraint=None), samples=True)
  no_eos = _row(a + b, spec, grammars, ignore_eos=True)
  mask = grammars.mask([fresh, free, accepting, no_eos], [0, 1, 3, 2], 4, eos_id=2)
  assert mask.shape == (4, V // 32) and mask.dtype == np.int32
  assert np.all(mask[1] == -1)  # no grammar: every id
  assert {tok.decode([i]) for i in _allowed(mask[0])} == {"a"}  # nothing to stop on before the grammar accepts
  assert _allowed(mask[3]) >= {2, 7} and all(tok.decode([i]) and set(tok.decode([i])) == {"b"}
                                             for i in _allowed(mask[3]) - {2, 7})
  assert 2 not in _allowed(mask[2]) and _allowed(mask[2])  # ignore_eos: more b's only
  assert max(_allowed(mask[3])) < grammars.tokenizer.vocab_size  # nothing past the tokenizer's ids
  assert grammars.mask([free], [0], 1, eos_id=2) is None  # no constrained row: the plain program


@pytest.mark.parametrize("body, want", [
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
   ("json", '{"type": "integer"}', "response_format")),
  ({"response_format": {"type": "json_object"}}, ("json", '{"type": "object"}', "response_format")),
  ({"response_format": {"type": "text"}}, None),
  ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+", "structured_outputs")),
  ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]', "structured_outputs")),
  ({"structured_outputs": {"json": '{"type": "string"}'}}, ("json", '{"type": "string"}', "structured_outputs")),
  ({"guided_choice": ["a"]}, ("choice", '["a"]', "guided_choice")),
  ({"response_format": {"type": "json_schema"}}, "response_format"),
  ({"response_format": {"type": "xml"}}, "response_format"),
  ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
  ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
  ({"structured_outputs": {"choice": []}}, "structured_outputs"),
  ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
  # boolean schemas are schemas (true: any JSON value; false: a 400 when compiled), json_object a boolean
  ({"structured_outputs": {"json": True}}, ("json", "true", "structured_outputs")),
  ({"structured_outputs": {"json": False}}, ("json", "false", "structured_outputs")),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
   ("json", "true", "response_format")),
  ({"structured_outputs": {"json_object": False}}, None),
  ({"structured_outputs": {"json_object": True}}, ("json", '{"type": "object"}', "structured_outputs")),
  ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
  ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
  ({"structured_outputs": {"regex": 0}}, "structured_outputs"),
  ({"structured_outputs": {"json_object": False, "regex": "a"}}, ("regex", "a", "structured_outputs")),
  # falsy values are values: an empty guided_* is a 400 naming it, never "no grammar"
  ({"guided_choice": []}, "guided_choice"),
  ({"guided_regex": ""}, "guided_regex"),
  ({"guided_json": {}}, ("json", "{}", "guided_json")),
  ({"response_format": {}}, None),
  ({"response_format": {"type": "json_object"}, "structured_outputs": {}}, ("json", '{"type": "object"}', "response_format")),
  ({"structured_outputs": {"json": {}}, "guided_json": {}}, "guided_json"),
])
def test_request_fields_become_one_grammar_or_a_400_naming_the_field(body, want):
  for request in (CompletionRequest(prompt="x", **body), ChatRequest(messages=[{"role": "user", "content": "x"}],
                                                                     **body)):
    if isinstance(want, str):
      with pytest.raises(ApiError) as e:
        grammar_spec(request)
      assert e.value.status == 400 and e.value.param == want
    else:
      assert grammar_spec(request) == (GrammarSpec(*want) if want else None)


def test_bad_schema_or_regex_is_a_400_with_openais_body_before_the_engine(grammars, tok):
  eng = ScriptedEngine()
  texts = Texts(tok, add_bos=False, vocab_size=V, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                chat_template_source="test", special_tokens={})

  def app(with_grammars):
    engine = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
    return build_app(Server(make_config(), texts, engine, "tiny", grammars=grammars if with_grammars else None))

  bad = [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integr"}}}},
          "response_format", "integr"),
         ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
         ({"guided_json": "{not json"}, "guided_json", "not JSON"),
         ({"response_format": {"type": "json_schema", "json_schema": {"schema": False}}}, "response_format",
          "matches no value"),
         ({"structured_outputs": {"json": False}}, "structured_outputs", "matches no value")]
  with TestClient(app(True)) as client:
    for body, field, said in bad:
      for url, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "hi"}]})):
        got = client.post(url, json={**base, **body, "max_tokens": 4})
        assert got.status_code == 400, (url, body, got.text)
        error = got.json()["error"]
        assert error["param"] == field and said in error["message"] and error["type"] == "invalid_request_error"
  with TestClient(app(False)) as client:  # a server without a tokenizer.json
    got = client.post("/v1/completions", json={"prompt": "hi", "structured_outputs": {"choice": ["a"]}})
    assert got.status_code == 400 and "tokenizer.json" in got.json()["error"]["message"]
  assert eng.requests == []  # none reached the engine
  assert json.loads(grammar_spec(CompletionRequest(prompt="x", guided_json={"type": "null"})).source) == {"type": "null"}


def test_schema_true_is_any_json_value_and_any_compile_failure_is_a_grammar_error(grammars, tok, monkeypatch):
  """JSON Schema's `true` accepts any JSON value (llguidance raises ValueError on a bare boolean: that was a 500);
  whatever the compile raises becomes a GrammarError naming the field, which the server answers with a 400."""
  from MaxText.inference import grammar
  spec = GrammarSpec("json", "true", "structured_outputs")
  for value in ("5", "[1, 2]", '"a"', '{"k": null}'):
    assert _row(tok.encode(value), spec, grammars).request.constraint.matcher.is_accepting(), value
  def broken(spec):
    raise RuntimeError("boom")
  monkeypatch.setattr(grammar, "llg_grammar", broken)
  with pytest.raises(grammar.GrammarError, match="guided_regex: the grammar does not compile: boom") as e:
    grammars.compile(GrammarSpec("regex", "zz-never-cached", "guided_regex")).result()
  assert e.value.field == "guided_regex"
