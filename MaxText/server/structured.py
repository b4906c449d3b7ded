"""Structured outputs on the wire: a request's grammar from OpenAI's `response_format` or vLLM's
`structured_outputs` (and its older `guided_json` / `guided_regex` / `guided_choice`), compiled before
the request is submitted so that a bad schema is a 400 naming the field (inference/grammar.py compiles
it on its worker thread: neither the event loop nor the engine waits).

    response_format: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
                     {"type": "json_object"}                   (any JSON object)
                     {"type": "text"}                          (no grammar)
    structured_outputs: {"json": schema} | {"regex": "..."} | {"choice": ["a", "b"]} | {"json_object": true}
Both endpoints take them. One grammar a request: two of these together are a 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from MaxText.inference.grammar import GrammarError, GrammarSpec
from MaxText.server.protocol import ApiError

ANY_OBJECT = '{"type": "object"}'
_VLLM_KINDS = {"json": "json", "regex": "regex", "choice": "choice"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


def _source(kind: str, value: Any, field: str) -> str:
  """A spec's source text: a schema (dict or its JSON text), a regex string, a list of strings."""
  if kind == "json":
    if isinstance(value, str):
      return value
    if isinstance(value, (dict, bool)):
      return json.dumps(value)
    raise ApiError(400, f"{field}: a JSON schema is an object, not {type(value).__name__}", field)
  if kind == "regex":
    if not isinstance(value, str) or not value:
      raise ApiError(400, f"{field}: regex is a non-empty string", field)
    return value
  if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
    raise ApiError(400, f"{field}: choice is a non-empty list of non-empty strings", field)
  return json.dumps(value)


def _from_response_format(rf: dict) -> GrammarSpec | None:
  kind = rf.get("type")
  if kind in (None, "text"):
    return None
  if kind == "json_object":
    return GrammarSpec("json", ANY_OBJECT, "response_format")
  if kind == "json_schema":
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
      raise ApiError(400, 'response_format: type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
                     "response_format")
    return GrammarSpec("json", _source("json", js["schema"], "response_format"), "response_format")
  raise ApiError(400, f'response_format: type {kind!r} is not "text", "json_object" or "json_schema"',
                 "response_format")


def _from_structured_outputs(so: dict) -> GrammarSpec | None:
  """One of json (a schema: false is one, a 400 when compiled), regex, choice, json_object (true: any object)."""
  if not isinstance(so.get("json_object", False), bool):
    raise ApiError(400, f"structured_outputs: json_object is true or false, not {so['json_object']!r}",
                   "structured_outputs")
  given = [k for k in _VLLM_KINDS if so.get(k) is not None] + (["json_object"] if so.get("json_object") else [])
  other = [k for k in so if k not in (*_VLLM_KINDS, "json_object") and so[k] is not None]
  if other:
    raise ApiError(400, f"structured_outputs: {other[0]!r} is not supported: give one of json, regex, choice, "
                   "json_object", "structured_outputs")
  if len(given) > 1:
    raise ApiError(400, f"structured_outputs: give one of json, regex, choice, json_object, not {given}",
                   "structured_outputs")
  if not given:
    return None
  if given[0] == "json_object":
    return GrammarSpec("json", ANY_OBJECT, "structured_outputs")
  return GrammarSpec(_VLLM_KINDS[given[0]], _source(given[0], so[given[0]], "structured_outputs"),
                     "structured_outputs")


def grammar_spec(body) -> GrammarSpec | None:
  """The request's grammar (None: free text); ApiError 400 naming the field for a malformed one."""
  specs = []
  if isinstance(body.response_format, dict):
    specs.append(_from_response_format(body.response_format))
  elif body.response_format is not None:
    raise ApiError(400, "response_format: an object such as {\"type\": \"json_object\"}", "response_format")
  if body.structured_outputs is not None:
    specs.append(_from_structured_outputs(body.structured_outputs))
  for field, kind in _GUIDED.items():
    value = getattr(body, field)
    if value is not None:
      specs.append(GrammarSpec(kind, _source(kind, value, field), field))
  specs = [s for s in specs if s is not None]
  if len(specs) > 1:
    raise ApiError(400, f"{specs[1].field}: one grammar a request, and {specs[0].field} already gives one",
                   specs[1].field)
  return specs[0] if specs else None


async def compiled(grammars, spec: GrammarSpec) -> None:
  """Waits (without blocking the event loop) for the spec's grammar to compile; ApiError 400 naming the
  field when it does not, or when the server has no grammar support (no tokenizer.json)."""
  if grammars is None:
    raise ApiError(400, f"{spec.field}: structured outputs need the server's tokenizer as a Hugging Face "
                   "tokenizer.json (tokenizer_type=hf tokenizer_path=...)", spec.field)
  try:
    await asyncio.wrap_future(grammars.compile(spec))
  except GrammarError as e:
    raise ApiError.bad_field(e) from None
