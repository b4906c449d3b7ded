"""tool_choice "required" or a named function, enforced: a grammar (llguidance's Lark) that admits exactly DSML
calls of the offered tools whose arguments match their "parameters" schemas, as vLLM enforces required / named
tool choice with guided decoding. The reply was started with the block's opening (server/chat.py's forced
start), so the grammar is the rest of it:

  required:  invoke ("\n" invoke)* "\n" </function_calls>    (one invoke with parallel_tool_calls false)
  named:     that function's parameters "</invoke>\n</function_calls>" (the invoke's opening is forced)
  invoke:    <invoke name="NAME">\n (parameter "\n")* </invoke>, any offered tool
  parameter: a property of the tool's schema, in declared order, each one its "required" list names present
             (no "required": every property optional, as JSON schema says; a required name that is not a
             property: any value); no other names (as if additionalProperties were false). Its value is
             written as server/tool_values.py says: string="true" and the raw text of a string matching the
             schema (any character, "<" too), or string="false" and other JSON matching it (llguidance's
             JSON-schema grammar, %json, with the tool's $defs).

Once the block closes the grammar is complete and the engine ends the request ("stop"): the parser sees a
whole block and the reply is `tool_calls` with finish_reason "tool_calls". The DSML marker is matched as its
token when the tokenizer has it as one token (a special token cannot be spelled as text).

A forced call closes within its budget (the request's max_tokens; the rest of the context when it gives none):
each string value other than an enum's is held to `room` UTF-8 bytes (tool_values._length: ASCII text that many
characters, text with wider characters fewer), the same for each, so that the longest call the tool allows fits
in the budget at one token per byte (a token is at least a byte, as a random writer may spell everything), with
JSON_RESERVE tokens per value written as JSON. A value written as JSON (an integer, an array) is not held so: a
free-form one can still run into max_tokens (finish_reason "length"), and so can more calls than one under
"required" with parallel_tool_calls.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from MaxText.data import chat_dsv32 as fmt
from MaxText.inference.grammar import JSON_LAYOUT, GrammarSpec
from MaxText.server import tool_values as tv

JSON_RESERVE = 8  # tokens a JSON value is budgeted (a number, a boolean: a few)


def _q(text: str) -> str:
  """A Lark string literal of text."""
  return json.dumps(text, ensure_ascii=False)


def _seq(*parts: str) -> str:
  """Literal text as a Lark sequence: the DSML marker as the `d` rule, and "\n", "<", "</" each a literal of
  its own (llguidance's lexer takes the longest literal and does not back off: "\n</" beside "\n" would
  swallow the "<" of a next invoke)."""
  out = []
  for part in parts:
    for i, p in enumerate(part.split(fmt.DSML)):
      if i:
        out.append("d")
      out += [_q(x) for x in re.split(r"(\n|</|<)", p) if x]
  return " ".join(out)


def _head(key: str, is_string: str) -> str:
  return fmt.PARAMETER_TEMPLATE.format(name=key, is_string=is_string, value="\0").split("\0")[0]


def _invoke_head(name: str) -> str:
  return fmt.INVOKE_TEMPLATE.format(name=name, parameters="\0").split("\0")[0]


def _tokens(text: str, dsml_token: bool) -> int:
  """At most this many tokens spell `text` (a token is at least one byte; the marker one token when it is one)."""
  return len((text.replace(fmt.DSML, "\0") if dsml_token else text).encode())


class _Tool:
  """One offered tool's parameters: each property's Value, which are required, and its strings' room."""

  def __init__(self, i: int, tool: dict):
    fn = tool["function"]
    where = f"tools[{i}].function.parameters"
    self.name, self.root = fn["name"], fn.get("parameters") or {}
    props, required = self.root.get("properties") or {}, self.root.get("required", [])
    if not isinstance(props, dict):
      raise fmt.ChatFormatError(f"{where}.properties must be an object of schemas", f"{where}.properties")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
      raise fmt.ChatFormatError(f"{where}.required must be a list of property names", f"{where}.required")
    self.required = set(required)
    self.values: dict[str, tv.Value] = {}
    self.json: dict[str, dict | None] = {}  # each value's %json schema (None: a string only)
    for key in [*props, *(k for k in dict.fromkeys(required) if k not in props)]:
      if re.search(r'["<>]', key):
        raise fmt.ChatFormatError(f"{where}.properties: the name {key!r} cannot be written in DSML (no '\"', '<' or "
                                  "'>')", f"{where}.properties")
      v = tv.value(props.get(key, True), self.root, f"{where}.properties.{key}")
      if tv.raw_terminal(v.raw, "", None) is None:
        v.raw = []  # no string fits (maxLength < minLength, an enum of texts the format cannot hold)
      for r in v.raw:
        if r.pattern is not None:
          tv.check_pattern(r.pattern, f"{where}.properties.{key}")
      self.json[key] = tv.json_schema(v, self.root)
      if self.json[key] is not None:
        tv.check_json(self.json[key], f"{where}.properties.{key}")
      if v.raw or v.json:
        self.values[key] = v
      elif key in self.required:
        raise fmt.ChatFormatError(f"{where}.properties.{key}: a required property whose schema admits no value",
                                  f"{where}.properties.{key}")

  def room(self, budget: int | None, fixed: str, dsml_token: bool) -> int | None:
    """The UTF-8 bytes each string value other than an enum's may have so that the longest call fits in `budget`
    tokens (fixed: the block's text around the parameters); None without a budget or such a value."""
    free = [k for k, v in self.values.items() if any(r.enum is None for r in v.raw)]
    if budget is None or not free:
      return None
    used = _tokens(fixed, dsml_token)
    for key, v in self.values.items():
      head = _head(key, "false") if v.json else _head(key, "true")  # the longer of the ways it may be written
      used += _tokens(head + tv.PARAMETER_CLOSE + "\n", dsml_token)
      used += max([len(e.encode()) for r in v.raw for e in (r.enum or ())] + [JSON_RESERVE if v.json else 0])
    return max(0, (budget - used) // len(free))

  def params_rules(self, i: int, room: int | None, dsml_token: bool) -> list[str]:
    """Rules params{i} (the invoke's parameter lines) and each parameter's p{i}_{j}."""
    end = "</" if dsml_token else tv.PARAMETER_CLOSE  # what a raw value's lexeme ends with
    after = 'd "parameter>"' if dsml_token else ""
    rules, items = [], []
    for j, (key, v) in enumerate(self.values.items()):
      rule, alts = f"p{i}_{j}", []
      raw = tv.raw_terminal(v.raw, end, room)
      if raw is not None:
        rules.append(f"S{i}_{j}: {raw}")
        alts.append(f"{_seq(_head(key, 'true'))} S{i}_{j} {after}")
      if self.json[key] is not None:
        rules.append(f"{rule}_j: %json " + json.dumps({**self.json[key], "x-guidance": JSON_LAYOUT}))
        alts.append(f"{_seq(_head(key, 'false'))} {rule}_j {_seq(tv.PARAMETER_CLOSE)}")
      rules.append(f"{rule}: " + " | ".join(alts))
      items.append(f'{rule} "\\n"' if key in self.required else f'({rule} "\\n")?')
    # no parameter written (none required): the format renders the invoke's "\n\n" (INVOKE_TEMPLATE), which a
    # "\n" here completes (the parser takes the invoke either way)
    empty = "" if self.required & set(self.values) else f" | {_q(chr(10))}"
    return [f"params{i}: {' '.join(items)}{empty}" if items else f"params{i}: {_q(chr(10))}?"] + rules


class ForcedCall:
  """A forced tool call's grammar for a request: the tools' schemas read once (a ChatFormatError naming a schema
  this cannot hold), then spec(budget) for its max_tokens. name None: tool_choice "required" (any offered tool,
  several calls unless parallel is false), else the named one (its invoke already opened). dsml_id: the DSML
  marker's token id when it is one token (matched as that token), else None (text)."""

  def __init__(self, tools: Sequence[dict], name: str | None, parallel: bool, dsml_id: int | None):
    self.name, self.parallel, self.dsml_id = name, parallel, dsml_id
    self.names = [t["function"]["name"] for t in tools]
    self.tools = [(i, _Tool(i, t)) for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]

  def rooms(self, budget: int | None) -> dict[str, int | None]:
    """Each tool's room (UTF-8 bytes) for each of its string values other than an enum's under `budget`."""
    end = f"</{fmt.DSML}invoke>\n" + fmt.CALLS_CLOSE  # the invoke's opening too under "required"
    return {t.name: t.room(budget, ("" if self.name is not None else _invoke_head(t.name)) + end,
                          self.dsml_id is not None) for _, t in self.tools}

  def spec(self, budget: int | None = None) -> GrammarSpec:
    """The grammar of the rest of the block; budget: the request's max_tokens (string values held to fit it),
    None for no bound but their maxLength."""
    dsml_token = self.dsml_id is not None
    end_invoke, end_calls = f"</{fmt.DSML}invoke>", "\n" + fmt.CALLS_CLOSE
    rules = [f"d: <[{self.dsml_id}]>" if dsml_token else f"d: {_q(fmt.DSML)}"]
    rooms = self.rooms(budget)
    for i, t in self.tools:
      rules += t.params_rules(i, rooms[t.name], dsml_token)
      if self.name is None:
        rules.append(f"inv{i}: {_seq(_invoke_head(t.name))} params{i} {_seq(end_invoke)}")
    if self.name is not None:
      start = f"start: params{self.names.index(self.name)} {_seq(end_invoke + end_calls)}"
    else:
      rules.append("invoke: " + " | ".join(f"inv{i}" for i, _ in self.tools))
      start = f"start: invoke {'(' + _q(chr(10)) + ' invoke)* ' if self.parallel else ''}{_seq(end_calls)}"
    return GrammarSpec("lark", "\n".join([start, *rules]), "tool_choice")


def tool_call_grammar(tools: Sequence[dict], name: str | None, parallel: bool, dsml_id: int | None,
                      budget: int | None = None) -> GrammarSpec:
  """ForcedCall(tools, name, parallel, dsml_id).spec(budget)."""
  return ForcedCall(tools, name, parallel, dsml_id).spec(budget)


__all__ = ["ForcedCall", "tool_call_grammar", "JSON_RESERVE"]
