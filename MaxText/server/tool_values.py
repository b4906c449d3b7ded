"""One parameter's value in a forced tool call's grammar (server/tool_grammar.py), from the property's JSON
schema, in the two ways DSML writes a value (chat_dsv32.render_tool_calls, parse_tool_block):

  string="true">RAW</｜DSML｜parameter>    a JSON string, written raw: any characters (newlines, quotes, "<",
                  "</") but the closing tags' own text (ENDS), where the parser ends what it reads. The string
                  keywords hold RAW: enum / const, pattern (searched, as JSON schema and llguidance's JSON
                  grammar read it: a "^" first or a "$" last anchors it), minLength / maxLength (characters).
  string="false">JSON</｜DSML｜parameter>  any other value as JSON (json.dumps' layout) matching the schema with
                  strings taken out, compiled by llguidance's JSON-schema grammar (%json): number bounds, enum
                  and const (numbers too), nested objects with their required and additionalProperties, arrays.

A schema admitting strings and other values (no "type", a type list, anyOf / oneOf branches, a mixed enum)
offers both; the flag the model writes decides which. "$ref" into the tool's own "$defs" / "definitions"
(pydantic's style) is followed, in both ways; "allOf" of one schema is that schema. Not applied to RAW:
"format" (an annotation unless a validator is asked to check it); to a string inside a JSON value: ENDS (the
JSON grammar cannot leave them out; a model writes one there by a rare chance only). A schema this cannot hold (a pattern
llguidance's regex cannot read, a keyword its JSON grammar lacks, a "$ref" outside the tool, "allOf" of several
schemas around a string) is a ChatFormatError naming its place (a 400).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from MaxText.data import chat_dsv32 as fmt

PARAMETER_CLOSE = f"</{fmt.DSML}parameter>"
# The texts a raw value never holds: the parser ends the value, its invoke, its block or the completion at the
# first of each (chat_dsv32.parse_completion, parse_tool_block). Each starts with its only "<", so a value
# followed by PARAMETER_CLOSE never makes one across the seam.
ENDS = (PARAMETER_CLOSE, f"</{fmt.DSML}invoke>", fmt.CALLS_CLOSE, fmt.EOS)
NOT_STRING = ["number", "boolean", "null", "object", "array"]  # JSON's types but string ("integer" is a number)
_MAX_REFS = 64  # "$ref"s followed for one value (a cycle of bare references ends here as a 400)


@dataclasses.dataclass(frozen=True)
class Raw:
  """One kind of string a value may be, written raw: one of `enum` (None: any), matching `pattern` (None: any),
  of min_length to max_length characters (max None: no bound)."""
  enum: tuple[str, ...] | None = None
  pattern: str | None = None
  min_length: int = 0
  max_length: int | None = None


@dataclasses.dataclass
class Value:
  """What a value may be: the strings (raw: each a Raw; empty: no string) and the other JSON values (the
  schemas of the branches; empty: none)."""
  raw: list[Raw] = dataclasses.field(default_factory=list)
  json: list[dict] = dataclasses.field(default_factory=list)


def _json_type(v: Any) -> str:
  return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", list: "array",
          dict: "object"}.get(type(v), "object")


def _admits(types: list[str], v: Any) -> bool:
  """A JSON value of type list `types` (as "type" lists them) may be v."""
  t = _json_type(v)
  return t in types or (t == "integer" and "number" in types) or (
      t == "number" and "integer" in types and float(v).is_integer())


def _resolve(ref: Any, root: dict, where: str) -> dict | bool:
  """A "$ref" inside the tool's parameters schema (#/$defs/X, #/definitions/X, #/properties/..., #)."""
  if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
    raise fmt.ChatFormatError(f"{where}.$ref={ref!r}: only references into this tool's parameters schema "
                              "(\"#/$defs/...\") are followed", f"{where}.$ref")
  node: Any = root
  for part in ref[2:].split("/") if ref != "#" else []:
    part = part.replace("~1", "/").replace("~0", "~")
    node = node.get(part) if isinstance(node, dict) else None
    if node is None:
      raise fmt.ChatFormatError(f"{where}.$ref={ref!r} names nothing in this tool's parameters schema", f"{where}.$ref")
  return node


def _int(schema: dict, key: str, where: str) -> int | None:
  v = schema.get(key)
  if v is not None and (type(v) is not int or v < 0):
    raise fmt.ChatFormatError(f"{where}.{key} must be a non-negative integer, not {v!r}", f"{where}.{key}")
  return v


def _raw(schema: dict, where: str) -> Raw:
  """The string keywords of a schema as a Raw."""
  pattern = schema.get("pattern")
  if pattern is not None and not isinstance(pattern, str):
    raise fmt.ChatFormatError(f"{where}.pattern must be a string (a regex), not {pattern!r}", f"{where}.pattern")
  return Raw(None, pattern, _int(schema, "minLength", where) or 0, _int(schema, "maxLength", where))


def value(schema: Any, root: dict, where: str, refs: int = 0) -> Value:
  """What a value matching `schema` may be (root: the tool's parameters schema, which "$ref"s read; where: the
  schema's place for errors, e.g. tools[0].function.parameters.properties.city)."""
  if schema is True or schema == {}:
    return Value([Raw()], [{"type": NOT_STRING}])
  if schema is False:
    return Value()
  if not isinstance(schema, dict):
    raise fmt.ChatFormatError(f"{where} must be a JSON schema (an object), not {schema!r}", where)
  if "$ref" in schema:
    if refs >= _MAX_REFS:
      raise fmt.ChatFormatError(f"{where}.$ref: more than {_MAX_REFS} references in a row (a cycle?)", f"{where}.$ref")
    target = _resolve(schema["$ref"], root, where)
    rest = {k: v for k, v in schema.items() if k != "$ref"}
    return value({**target, **rest} if rest and isinstance(target, dict) else target, root, where, refs + 1)
  if "allOf" in schema:
    parts = schema["allOf"]
    rest = {k: v for k, v in schema.items() if k != "allOf"}
    if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict):
      return value({**rest, **parts[0]}, root, where, refs)
    types = rest.get("type")
    if types is not None and "string" not in (types if isinstance(types, list) else [types]):
      return Value([], [schema])
    raise fmt.ChatFormatError(f"{where}.allOf: several schemas together are not supported for a parameter that may "
                              "be a string: give \"type\" without \"string\", or one schema", f"{where}.allOf")
  for key in ("anyOf", "oneOf"):
    if key in schema:
      branches = schema[key]
      if not isinstance(branches, list) or not branches:
        raise fmt.ChatFormatError(f"{where}.{key} must be a non-empty list of schemas", f"{where}.{key}")
      rest = {k: v for k, v in schema.items() if k != key}
      out = Value()
      for i, b in enumerate(branches):
        v = value({**rest, **b} if isinstance(b, dict) else b, root, f"{where}.{key}[{i}]", refs)
        out.raw += v.raw
        out.json += v.json
      return out
  types = schema.get("type", ["string", *NOT_STRING])
  types = types if isinstance(types, list) else [types]
  if "enum" in schema or "const" in schema:
    enum = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(enum, list):
      raise fmt.ChatFormatError(f"{where}.enum must be a list, not {enum!r}", f"{where}.enum")
    strings = tuple(v for v in enum if isinstance(v, str) and "string" in types)
    others = [v for v in enum if not isinstance(v, str) and _admits(types, v)]
    return Value([dataclasses.replace(_raw(schema, where), enum=strings)] if strings else [],
                 [{"enum": others}] if others else [])
  others = [t for t in types if t != "string"]
  return Value([_raw(schema, where)] if "string" in types else [], [{**schema, "type": others}] if others else [])


# ---------------------------------------------------------------- the raw string as a Lark terminal


def _pattern(pattern: str) -> str:
  """A JSON-schema pattern as a regex matched whole: searched (any text around it) unless "^" starts it or "$"
  ends it (llguidance's regexes have no anchors: those two are taken off, any other is an error)."""
  import llguidance as llg
  head = pattern.startswith("^")
  tail = re.search(r"(?<!\\)(\\\\)*\$$", pattern) is not None
  body = pattern[int(head):len(pattern) - int(tail)]
  return ("" if head else "(?s:.*)") + "(?:" + llg.regex_to_lark(body, "dw") + ")" + ("" if tail else "(?s:.*)")


def check_pattern(pattern: str, where: str) -> None:
  """A ChatFormatError naming where.pattern when llguidance's regex cannot read the pattern."""
  import llguidance as llg
  error = llg.LLMatcher.validate_grammar(llg.grammar_from("lark", f"start: S\nS: /{_pattern(pattern)}/"))
  if error:
    raise fmt.ChatFormatError(f"{where}.pattern={pattern!r} is not a regex this server can hold a value to: "
                              f"{error.splitlines()[0]}", f"{where}.pattern")


_WIDTHS = ((1, r"[\x00-\x7F]"), (2, r"[\x00-\x{7FF}]"), (3, r"[\x00-\x{FFFF}]"), (4, r"(?s:.)"))  # UTF-8 bytes


def _length(r: Raw, room: int | None) -> str | None:
  """The regex of r's minLength / maxLength, and under `room` (bytes, None: no room given) of a string at most that
  long in UTF-8: as many characters as room holds of the widest one it has (ASCII: room; up to 2-byte
  characters: room // 2; ...), never fewer than minLength (a value that long may then not fit). None: no
  string fits (maxLength < minLength)."""
  if room is None:
    top = "" if r.max_length is None else r.max_length
    return f"/(?s:.{{{r.min_length},{top}}})/" if top == "" or top >= r.min_length else None
  tiers = []
  for width, chars in _WIDTHS:
    top = max(room // width, r.min_length)
    top = top if r.max_length is None else min(top, r.max_length)
    if top >= r.min_length:
      tiers.append(f"/{chars}{{{r.min_length},{top}}}/")
  return "(" + " | ".join(tiers) + ")" if tiers else None


def raw_terminal(raws: list[Raw], end: str, room: int | None) -> str | None:
  """The Lark terminal of a raw string value and the text `end` after it ("</" when the DSML marker is its own
  token, the whole closing tag when it is text): one lexeme, so that "<" and "</" inside the value never end it
  early (llguidance's lexer does not back off). room: the most UTF-8 bytes a value other than an enum's may
  have (None: no bound but its maxLength). None when no string is possible."""
  alts = []
  for r in raws:
    if r.enum is not None:
      values = [v for v in r.enum if not any(e in v for e in ENDS) and r.min_length <= len(v)
                and (r.max_length is None or len(v) <= r.max_length)]
      if not values:
        continue
      parts = ["(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in values) + ")"]
    else:
      length = _length(r, room)
      if length is None:
        continue
      parts = [length, "~/(?s:.*)(" + "|".join(re.escape(e).replace("/", r"\/") for e in ENDS) + ")(?s:.*)/"]
    if r.pattern is not None:
      parts.append(f"/{_pattern(r.pattern)}/")
    alts.append("(" + " & ".join(parts) + ")")
  if not alts:
    return None
  return "(" + " | ".join(alts) + ") " + json.dumps(end, ensure_ascii=False)


def check_json(schema: dict, where: str) -> None:
  """A ChatFormatError naming `where` when llguidance's JSON-schema grammar cannot hold the schema (a keyword it
  does not implement, such as "not" or "if", an unknown type, bounds nothing satisfies)."""
  import llguidance as llg
  error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
  if error:
    raise fmt.ChatFormatError(f"{where}: {error.splitlines()[0]}", where)


def json_schema(v: Value, root: dict) -> dict | None:
  """The %json schema of a value's non-string branches, with the tool's "$defs" / "definitions" beside it (so
  that its "$ref"s resolve); None when the value is never anything but a string."""
  if not v.json:
    return None
  schema = v.json[0] if len(v.json) == 1 else {"anyOf": v.json}
  defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
  return {**schema, **defs}


__all__ = ["Raw", "Value", "value", "raw_terminal", "json_schema", "check_pattern", "check_json", "PARAMETER_CLOSE", "ENDS",
           "NOT_STRING"]
