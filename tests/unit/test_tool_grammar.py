"""MaxText/server/tool_grammar.py: a forced tool call's grammar admits the DSML the format renders for a
valid call and nothing else (another function, a missing required parameter, a value off its schema),
and an adversarial sampler (a uniformly random allowed token at every step, many seeds) always ends in a
block that parses into calls of the offered tools whose arguments match their schemas."""

import json
import os

import llguidance as llg
import llguidance.numpy as lln
import numpy as np
import pytest

from MaxText.data import chat_dsv32 as fmt
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import llg_grammar
from MaxText.server.tool_grammar import tool_call_grammar
from tests.conftest import REPO_ROOT

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
TOOLS = [
  {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
      "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
      "note": {"type": "string"}}}}},
  {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                            "b": {"type": "boolean"}}}}},
  {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
START = fmt.CALLS_SEP + fmt.CALLS_OPEN + "\n"  # server/chat.py's forced start of "required"


@pytest.fixture(scope="module")
def tok():
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=TOKENIZER)
  with open(TOKENIZER, encoding="utf-8") as f:
    return tok, llg.LLTokenizer(f.read(), eos_token=tok.eos_id)


def _matcher(tok, name=None, parallel=True):
  spec = tool_call_grammar(TOOLS, name, parallel, tok[0].encode(fmt.DSML)[0])
  m = llg.LLMatcher(tok[1], llg_grammar(spec), log_level=0)
  assert not m.is_error(), m.get_error()
  return m


def _takes(tok, text, name=None, parallel=True) -> bool:
  m = _matcher(tok, name, parallel)
  return all(m.consume_token(t) for t in tok[0].encode(text)) and m.is_stopped()


def _block(calls):
  """The rest of the block after START, as the format renders these calls."""
  full = fmt.render_tool_calls([{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                for n, a in calls])
  return full[len(fmt.CALLS_OPEN) + 1:]


def test_the_grammar_takes_the_formats_own_rendering_of_valid_calls_and_nothing_else(tok):
  good = [("get_weather", {"city": "Rome", "days": 3}), ("add", {"a": 4, "b": True})]
  assert _takes(tok, _block(good)) and _takes(tok, _block(good[:1]), parallel=False)
  assert not _takes(tok, _block(good), parallel=False)  # parallel_tool_calls false: one call
  for bad in ([("get_time", {})], [("add", {"a": 4})], [("add", {"a": "4", "b": True})],
              [("get_weather", {"city": "Oslo"})], [("add", {"a": 100, "b": False})]):
    assert not _takes(tok, _block(bad)), bad
  named = _block([("add", {"a": 1, "b": False})])
  rest = named.split(">\n", 1)[1]  # after the forced '<invoke name="add">\n'
  assert _takes(tok, rest, name="add") and not _takes(tok, rest, name="get_weather")


def _valid(name, args) -> bool:
  props = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
  if not set(props.get("required", [])) <= set(args) <= set(props["properties"]):
    return False
  for k, v in args.items():
    s = props["properties"][k]
    ok = {"string": isinstance(v, str), "integer": type(v) is int, "boolean": type(v) is bool}[s["type"]]
    if not ok or v not in s.get("enum", [v]) or not s.get("minimum", v) <= v <= s.get("maximum", v):
      return False
  return True


def test_random_tokens_drawn_under_the_grammar_always_parse_into_valid_calls(tok):
  rng = np.random.default_rng(0)
  lt = tok[1]
  lt_ = lln.allocate_token_bitmask(1, lt.vocab_size)
  open_tag, slash = tok[0].encode("<")[0], tok[0].encode("/")[0]
  for seed in range(24):
    m, ids = _matcher(tok, parallel=seed % 2 == 0), []
    while not m.is_stopped() and len(ids) < 400:
      lln.fill_next_token_bitmask(m, lt_, 0)
      allowed = np.flatnonzero(np.unpackbits(lt_[0].view(np.uint8), bitorder="little")[:lt.vocab_size])
      allowed = allowed[allowed != tok[0].eos_id]
      pick = rng.choice(allowed)
      for tag, p in ((slash, 0.5), (open_tag, 0.3)):  # free text and repeated invokes end, sooner or later
        pick = tag if tag in allowed and rng.random() < p else pick
      assert m.consume_token(int(pick))
      ids.append(int(pick))
    assert m.is_stopped(), (seed, tok[0].decode(ids))
    parsed = fmt.parse_completion(START + tok[0].decode(ids), thinking=False)
    assert parsed.content == "" and parsed.tool_calls, (seed, tok[0].decode(ids))
    for call in parsed.tool_calls:
      assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"])), call
