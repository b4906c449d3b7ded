"""MaxText/server/tool_grammar.py and tool_values.py: a forced tool call's grammar admits the DSML the format
renders for a valid call and nothing else, value by value at each schema keyword's boundary (integer bounds,
exclusive bounds, minimum == maximum, enums of numbers and of falsy values, const, pattern anchors,
minLength / maxLength in characters, $ref / $defs as pydantic writes them, additionalProperties, "required"
and its absence), raw strings hold any character ("<", "</", quotes, newlines) but the closing tag's text,
and the marker as text (no DSML token) works the same. Under a budget an adversarial sampler (a uniformly
random allowed token at every step) always closes the call within max_tokens, and every call validates
against its schema (llguidance's own JSON-schema grammar on the parsed arguments)."""

import enum
import json
import os
import re

import llguidance as llg
import llguidance.numpy as lln
import numpy as np
import pydantic
import pytest

from MaxText.data import chat_dsv32 as fmt
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import JSON_LAYOUT, GrammarSpec, llg_grammar
from MaxText.server.tool_grammar import JSON_RESERVE, ForcedCall, tool_call_grammar
from tests.conftest import REPO_ROOT

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
D = fmt.DSML
TAIL = f"\n</{D}invoke>\n</{D}function_calls>"  # after a named call's last parameter line
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
CHAT_MD = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # docs/chat.md's tool
ENDS = (f"</{D}parameter>", f"</{D}invoke>", f"</{D}function_calls>", fmt.EOS)  # where the parser stops reading
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["n"]}}}


@pytest.fixture(scope="module")
def tok():
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=TOKENIZER)
  with open(TOKENIZER, encoding="utf-8") as f:
    return tok, llg.LLTokenizer(f.read(), eos_token=tok.eos_id)


def _matcher(tok, spec: GrammarSpec):
  m = llg.LLMatcher(tok[1], llg_grammar(spec), log_level=0)
  assert not m.is_error(), m.get_error()
  return m


def _ids(tok, text, marker_token=True):
  """Token ids of text: the marker as its token, or (marker_token False) everything, the format's special tokens
  too, spelled in plain text's tokens."""
  if marker_token:
    return tok[0].encode(text)
  pieces = re.split("(" + "|".join(map(re.escape, fmt.SPECIAL_TOKENS)) + ")", text)
  return [t for p in pieces for t in (tok[0].encode(p) if p not in fmt.SPECIAL_TOKENS else
                                      [t for ch in p for t in tok[0].encode(ch)])]


def _takes(tok, tools, text, name=None, parallel=True, budget=None, marker_token=True) -> bool:
  dsml = tok[0].encode(D)[0] if marker_token else None
  m = _matcher(tok, tool_call_grammar(tools, name, parallel, dsml, budget))
  return all(m.consume_token(t) for t in _ids(tok, text, marker_token)) and m.is_stopped()


def _tool(schema, required=True, extra=None):
  params = {"type": "object", "properties": {"x": schema}, **(extra or {})}
  if required:
    params["required"] = ["x"]
  return [{"type": "function", "function": {"name": "f", "parameters": params}}]


def _line(key, value, flag):
  return f'<{D}parameter name="{key}" string="{flag}">{value}</{D}parameter>\n'


def _one(tok, schema, value, flag, **kw) -> bool:
  """Does the named call f(x=value), written with string=flag, pass x's schema?"""
  return _takes(tok, _tool(schema), _line("x", value, flag) + TAIL.lstrip("\n"), name="f", **kw)


def _block(calls):
  """The rest of the block after the forced start, as the format renders these calls."""
  full = fmt.render_tool_calls([{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                for n, a in calls])
  return full[len(fmt.CALLS_OPEN) + 1:]


def test_the_grammar_takes_the_formats_own_rendering_of_valid_calls_and_nothing_else(tok):
  good = [("get_weather", {"city": "Rome", "days": 3}), ("add", {"a": 4, "b": True})]
  assert _takes(tok, TOOLS, _block(good)) and _takes(tok, TOOLS, _block(good[:1]), parallel=False)
  assert not _takes(tok, TOOLS, _block(good), parallel=False)  # parallel_tool_calls false: one call
  for bad in ([("get_time", {})], [("add", {"a": 4})], [("add", {"a": "4", "b": True})],
              [("get_weather", {"city": "Oslo"})], [("add", {"a": 100, "b": False})],
              [("add", {"a": 4, "b": True, "c": 1})]):  # c: not a property (additionalProperties)
    assert not _takes(tok, TOOLS, _block(bad)), bad
  rest = _block([("add", {"a": 1, "b": False})]).split(">\n", 1)[1]  # after the forced '<invoke name="add">\n'
  assert _takes(tok, TOOLS, rest, name="add") and not _takes(tok, TOOLS, rest, name="get_weather")


T, F = "true", "false"
GROUPS = [  # a schema, then (value, string flag, admitted) at its boundaries
  # a string "3" is no integer
  ({"type": "integer", "minimum": 1, "maximum": 7}, [
     ("1", F, True), ("7", F, True), ("0", F, False), ("8", F, False), ("3", T, False), ("3.5", F, False)]),
  ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3}, [
     ("1", F, True), ("2", F, True), ("0", F, False), ("3", F, False)]),
  ({"type": "integer", "minimum": 5, "maximum": 5}, [("5", F, True), ("4", F, False), ("6", F, False)]),
  # a bound of 0 is a bound
  ({"type": "integer", "minimum": 0, "maximum": 0}, [("0", F, True), ("1", F, False)]),
  ({"enum": [0, 2.5, -1]}, [("0", F, True), ("2.5", F, True), ("-1", F, True), ("1", F, False), ("0", T, False)]),
  ({"const": 0}, [("0", F, True), ("1", F, False)]),
  ({"const": False}, [("false", F, True), ("0", F, False)]),
  ({"const": ""}, [("", T, True), ("a", T, False)]),
  # a string is written raw, never as JSON
  ({"enum": ["a", 1]}, [("a", T, True), ("1", F, True), ("1", T, False), ("\"a\"", F, False)]),
  ({"type": "string", "enum": ["a<b", "</x>"]}, [("a<b", T, True), ("</x>", T, True), ("ab", T, False)]),
  ({"enum": ["a\nb", "q\"\\", "\u0001\t"]}, [("a\nb", T, True), ("q\"\\", T, True), ("\u0001\t", T, True), ("q", T, False)]),
  ({"const": {"a": [1, None]}}, [("{\"a\": [1, null]}", F, True), ("{\"a\": [1]}", F, False)]),
  ({"type": "string", "enum": ["ab", "abc", "abcd"], "minLength": 3, "maxLength": 3}, [
     ("abc", T, True), ("ab", T, False), ("abcd", T, False)]),
  ({"type": "string", "pattern": "^[A-Z][a-z]+$"}, [("Paris", T, True), ("paris", T, False), ("Paris1", T, False)]),
  ({"type": "string", "pattern": "ab"}, [("xaby", T, True), ("xy", T, False)]),
  ({"type": "string", "pattern": "^ab"}, [("abx", T, True), ("xab", T, False)]),
  ({"type": "string", "pattern": "ab$"}, [("xab", T, True), ("abx", T, False)]),
  # \d is ASCII, as in JSON schema's regex
  ({"type": "string", "pattern": "^\\d{2}$"}, [("12", T, True), ("1", T, False), ("١٢", T, False)]),
  ({"type": "string", "minLength": 2, "maxLength": 3}, [
     ("a", T, False), ("ab", T, True), ("abc", T, True), ("abcd", T, False)]),
  # characters, not bytes
  ({"type": "string", "maxLength": 3}, [("ééé", T, True), ("éééé", T, False)]),
  ({"type": "string", "minLength": 0, "maxLength": 0}, [("", T, True), ("a", T, False)]),
  ({"type": "string", "minLength": 1}, [("", T, False), ("a", T, True)]),
  ({"type": "string"}, [
     ("if a < b", T, True), ("a</b", T, True), ("</div>", T, True), ("say \"hi\"\nnow", T, True), ("", T, True),
     ("x", F, False)]),
  ({"type": "boolean"}, [("false", F, True), ("0", F, False)]),
  ({"type": ["string", "null"]}, [("null", F, True), ("null", T, True), ("1", F, False)]),
  ({"anyOf": [{"type": "integer", "maximum": 2}, {"type": "string", "maxLength": 1}]}, [
     ("2", F, True), ("3", F, False), ("z", T, True), ("zz", T, False)]),
  # any value; a string only raw
  ({}, [("anything <", T, True), ("[1, 2]", F, True), ("\"s\"", F, False)]),
  ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, [
     ("{\"a\": 1}", F, True), ("{\"a\": 1, \"b\": 2}", F, False)]),
  ({"type": "array", "items": {"type": "integer", "maximum": 3}, "maxItems": 2}, [
     ("[1, 3]", F, True), ("[4]", F, False), ("[1, 2, 3]", F, False)]),
  ({"type": "array", "maxItems": 0}, [("[]", F, True), ("[1]", F, False)]),
]
CASES = [(schema, value, flag, admitted) for schema, cases in GROUPS for value, flag, admitted in cases]


@pytest.mark.parametrize("schema, value, flag, admitted", CASES)
def test_a_value_is_admitted_exactly_when_its_schema_takes_it(tok, schema, value, flag, admitted):
  assert _one(tok, schema, value, flag) == admitted
  assert _one(tok, schema, value, flag, marker_token=False) == admitted  # the marker as text: the same


@pytest.mark.parametrize("schema", [{"type": "string"}, {"enum": ["a</b", f"a</{D}param", *(f"a{e}b" for e in ENDS)]}])
def test_a_raw_string_never_holds_a_closing_tags_text(tok, schema):
  """The parser ends a value, its invoke, its block or the completion at the first closing tag (or EOS) in the
  text, so the grammar never writes one inside a value (here spelled in plain bytes beside the marker's token,
  as a byte-level tokenizer can)."""
  dsml = tok[0].encode(D)[0]
  head, tail = _line("x", "\0", T).split("\0")
  for value, ok in (("a</b", True), (f"a</{D}param", True), *((f"a{e}b", False) for e in ENDS)):
    m = _matcher(tok, tool_call_grammar(_tool(schema), "f", True, dsml))
    ids = tok[0].encode(head) + _ids(tok, value, marker_token=False) + tok[0].encode(tail + TAIL.lstrip("\n"))
    assert (all(m.consume_token(t) for t in ids) and m.is_stopped()) == ok, value


class Unit(str, enum.Enum):
  C = "c"
  F = "f"


class Where(pydantic.BaseModel):
  city: str = pydantic.Field(max_length=12)
  country: str | None = None


class Forecast(pydantic.BaseModel):
  where: Where
  unit: Unit = Unit.C
  days: int = pydantic.Field(ge=1, le=7)
  also: list[Unit] = []  # a $ref inside a JSON value: %json resolves it in the tool's $defs


def test_pydantic_schemas_with_refs_and_defs_hold_every_value(tok):
  schema = Forecast.model_json_schema()
  assert "$defs" in schema and "$ref" in json.dumps(schema["properties"])
  tools = [{"type": "function", "function": {"name": "forecast", "parameters": schema}}]
  ok = {"where": {"city": "Paris", "country": None}, "unit": "f", "days": 3, "also": ["c", "f"]}
  assert _takes(tok, tools, _block([("forecast", ok)]))
  assert _takes(tok, tools, _block([("forecast", {"where": {"city": "Rome"}, "days": 7})]))  # unit: optional
  for bad in ({**ok, "unit": "k"}, {**ok, "days": 8}, {**ok, "where": {"city": "x" * 13}}, {"unit": "c", "days": 1},
              {**ok, "where": {"country": "Italy"}}, {**ok, "also": ["k"]}):
    assert not _takes(tok, tools, _block([("forecast", bad)])), bad


def test_no_required_list_means_every_parameter_is_optional(tok):
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "a": {"type": "integer"}, "b": {"type": "string"}}}}}]
  for args in ({}, {"b": "x"}, {"a": 0}, {"a": 1, "b": ""}):
    assert _takes(tok, tools, _block([("f", args)])), args
  need_a = [{"type": "function", "function": {"name": "f", "parameters": {**tools[0]["function"]["parameters"],
                                                                            "required": ["a"]}}}]
  assert not _takes(tok, need_a, _block([("f", {"b": "x"})])) and _takes(tok, need_a, _block([("f", {"a": 2})]))


def test_a_required_name_without_a_property_takes_any_value_and_an_impossible_optional_one_is_left_out(tok):
  tools = _tool({"type": "integer"}, required=False, extra={"required": ["z"]})  # x optional, z required, no schema
  assert _takes(tok, tools, _block([("f", {"z": "hi"})])) and _takes(tok, tools, _block([("f", {"x": 0, "z": 3})]))
  assert not _takes(tok, tools, _block([("f", {"x": 1})]))
  for schema in ({"enum": []}, {"type": "string", "minLength": 3, "maxLength": 2}, {"enum": [f"a</{D}invoke>"]}):
    never = _tool(schema, required=False)
    assert _takes(tok, never, _block([("f", {})])) and not _takes(tok, never, _block([("f", {"x": "abc"})]))


@pytest.mark.parametrize("params, field", [
  ({"properties": {"x": {"type": "string", "pattern": "("}}}, "properties.x.pattern"),
  ({"properties": {"x": {"$ref": "#/$defs/Nope"}}}, "properties.x.$ref"),
  ({"properties": {"x": {"$ref": "https://example.com/s.json"}}}, "properties.x.$ref"),
  ({"properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}},
   "properties.x.$ref"),  # a cycle of references

  ({"properties": {"x": {"enum": []}}, "required": ["x"]}, "properties.x"),
  ({"properties": {"x": {"type": "string", "minLength": 3, "maxLength": 2}}, "required": ["x"]}, "properties.x"),
  ({"properties": {"x": {"type": "string", "minLength": -1}}}, "properties.x.minLength"),
  ({"properties": {"x": {"anyOf": []}}}, "properties.x.anyOf"),
  ({"properties": {'a"b': {"type": "string"}}}, "properties"),
  ({"properties": {"x": {}}, "required": "x"}, "required"),
  ({"properties": {"x": {"type": "integer", "not": {"const": 3}}}}, "properties.x"),  # llguidance lacks "not"
  ({"properties": {"x": {"type": "integer", "minimum": 5, "maximum": 4}}}, "properties.x"),
  ({"properties": {"x": {"type": "array", "items": {"$ref": "#/$defs/Nope"}}}}, "properties.x"),
])
def test_a_schema_the_grammar_cannot_hold_is_an_error_naming_its_place(params, field):
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", **params}}}]
  with pytest.raises(fmt.ChatFormatError) as e:
    ForcedCall(tools, None, True, None)
  assert e.value.field == f"tools[0].function.parameters.{field}", e.value.field


def _spare(tok, tools, name, budget, args) -> int:
  """budget less the tokens of the named call with these arguments at one token per byte (the marker one)."""
  rest = _block([(name, args)]).split(">\n", 1)[1]  # after the forced invoke opening
  return budget - len(rest.replace(D, "\0").encode())


def test_the_budget_holds_a_string_to_its_room_in_utf8_bytes_exactly(tok):
  room = ForcedCall([CHAT_MD], "get_weather", True, tok[0].encode(D)[0]).rooms(128)["get_weather"]
  assert 16 < room < 64 and ForcedCall([CHAT_MD], "get_weather", True, None).rooms(None) == {"get_weather": None}
  line = _line("city", "\0", T)
  for char, width in (("a", 1), ("é", 2), ("€", 3), ("\U0001d11e", 4)):
    n = room // width
    for value, ok in ((char * n, True), (char * (n + 1), False), ("a" + char * (n - 1), True)):
      text = line.replace("\0", value) + TAIL.lstrip("\n")
      assert _takes(tok, [CHAT_MD], text, name="get_weather", budget=128) == ok, (char, len(value))
  assert _spare(tok, [CHAT_MD], "get_weather", 128, {"city": "a" * room}) == 0  # the longest call fits, exactly
  two = _tool({"type": "string"}, extra={"properties": {"x": {"type": "string"}, "y": {"anyOf": [
      {"type": "string"}, {"type": "integer", "maximum": 9}]}}})
  room = ForcedCall(two, "f", True, tok[0].encode(D)[0]).rooms(200)["f"]
  spare = _spare(tok, two, "f", 200, {"x": "a" * room, "y": "a" * room})  # two strings share the room; y may be
  assert 0 <= spare < 2 + len("false") - len("true") + JSON_RESERVE      # JSON instead, which is budgeted too
  assert _spare(tok, two, "f", 200, {"x": "a" * room, "y": -10 ** (JSON_RESERVE - 2)}) >= 0  # y as JSON fits too
  assert _one(tok, {"type": "string", "maxLength": 2}, "ab", T, budget=10 ** 6)  # maxLength still holds
  assert not _one(tok, {"type": "string", "maxLength": 2}, "abc", T, budget=10 ** 6)
  assert _one(tok, {"type": "string", "minLength": 40}, "a" * 40, T, budget=64)  # never below a minLength
  assert _one(tok, {"enum": ["a" * 40]}, "a" * 40, T, budget=64)  # an enum is its own bound


def _draw(tok, spec: GrammarSpec, rng, limit: int) -> list[int]:
  """Uniformly random allowed tokens (never EOS) until the grammar completes or `limit` tokens."""
  m, ids = _matcher(tok, spec), []
  allowed_bits = lln.allocate_token_bitmask(1, tok[1].vocab_size)
  while not m.is_stopped() and len(ids) < limit:
    lln.fill_next_token_bitmask(m, allowed_bits, 0)
    allowed = np.flatnonzero(np.unpackbits(allowed_bits[0].view(np.uint8), bitorder="little")[:tok[1].vocab_size])
    pick = int(rng.choice(allowed[allowed != tok[0].eos_id]))
    assert m.consume_token(pick)
    ids.append(pick)
  return ids


def _valid(tok, schema: dict, args: dict) -> bool:
  """args match schema, as llguidance's JSON-schema grammar (not ours) reads it."""
  m = _matcher(tok, GrammarSpec("json", json.dumps(schema)))
  text = json.dumps(args, ensure_ascii=False, separators=(JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"]))
  return all(m.consume_token(t) for t in tok[1].tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize("tools, name, parallel, budget", [
  ([CHAT_MD], "get_weather", True, 128), ([CHAT_MD], None, False, 128), ([PICK], "pick", True, 64),
  (TOOLS, None, False, 200)])
def test_random_tokens_drawn_under_the_grammar_close_within_the_budget_into_valid_calls(tok, tools, name, parallel,
                                                                                       budget):
  rng = np.random.default_rng(0)
  spec = tool_call_grammar(tools, name, parallel, tok[0].encode(D)[0], budget)
  start = fmt.CALLS_SEP + fmt.CALLS_OPEN + "\n" + (f'<{D}invoke name="{name}">\n' if name else "")
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
  for seed in range(12):
    ids = _draw(tok, spec, rng, budget)
    text = tok[0].decode(ids)
    assert len(ids) <= budget and text.endswith(fmt.CALLS_CLOSE), (seed, text)
    parsed = fmt.parse_completion(start + text, thinking=False)
    assert parsed.content == "" and len(parsed.tool_calls) == 1, (seed, text)
    call = parsed.tool_calls[0]["function"]
    assert _valid(tok, schemas[call["name"]], json.loads(call["arguments"])), call


def test_sampling_md_states_the_room_the_grammar_gives_docs_chat_md_tool(tok):
  with open(os.path.join(REPO_ROOT, "docs", "sampling.md"), encoding="utf-8") as f:
    text = " ".join(f.read().split())
  room = {(name, budget): ForcedCall([CHAT_MD], name, True, tok[0].encode(D)[0]).rooms(budget)["get_weather"]
          for name in ("get_weather", None) for budget in (128, 256)}
  assert (f"at `max_tokens=128` leaves a named call's city {room['get_weather', 128]} bytes, a \"required\" one's "
          f"{room[None, 128]} (its invoke's opening is written too); at 256, {room['get_weather', 256]} and "
          f"{room[None, 256]}.") in text
