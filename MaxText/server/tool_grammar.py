"""tool_choice "required" or a named function, enforced: a grammar (llguidance's Lark, with each
non-string parameter's JSON schema embedded as %json) that admits exactly DSML calls of the offered
tools whose parameters match their schemas, as vLLM enforces required / named tool choice with
guided decoding. The reply was started with the block's opening (server/chat.py's forced start), so
the grammar is the rest of it:

  required:  invoke ("\n" invoke)* "\n" </function_calls>    (one invoke with parallel_tool_calls false)
  named:     that function's parameters "</invoke>\n</function_calls>" (the invoke's opening is forced)
  invoke:    <invoke name="NAME">\n (parameter "\n")* </invoke>, any offered tool
  parameter: a property of the tool's "parameters" schema, in its declared order, each "required" one
             present: <parameter name="KEY" string="true">text without "<"</parameter> for a "string"
             property (one of its values when it has an "enum"), else string="false" and JSON matching the
             property's schema (json.dumps' layout, grammar.JSON_LAYOUT).
Once the block closes the grammar is complete and the engine ends the request ("stop"): the parser sees a
whole block and the reply is `tool_calls` with finish_reason "tool_calls". The DSML marker is matched as
its token when the tokenizer has it as one token (a special token cannot be spelled as text).
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from MaxText.data import chat_dsv32 as fmt
from MaxText.inference.grammar import JSON_LAYOUT, GrammarSpec


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


def _parameter(rule: str, key: str, schema: dict) -> list[str]:
  """The Lark rules of one parameter named `rule` (its value rule `rule`_v)."""
  if schema.get("type") == "string":
    enum = [v for v in schema.get("enum", []) if isinstance(v, str) and "<" not in v]
    value = " | ".join(_q(v) for v in enum) if enum else "TEXT"
    head = fmt.PARAMETER_TEMPLATE.format(name=key, is_string="true", value="\0").split("\0")
  else:
    value = "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})
    head = fmt.PARAMETER_TEMPLATE.format(name=key, is_string="false", value="\0").split("\0")
  return [f"{rule}: {_seq(head[0])} {rule}_v {_seq(head[1])}", f"{rule}_v: {value}"]


def _invoke_body(i: int, tool: dict) -> list[str]:
  """Rules params{i}: the invoke's parameter lines, each "required" property present, in declared order."""
  params = tool["function"].get("parameters") or {}
  props = params.get("properties") or {}
  required = set(params.get("required") or [])
  rules, items = [], []
  for j, (key, schema) in enumerate(props.items()):
    rules += _parameter(f"p{i}_{j}", key, schema if isinstance(schema, dict) else {})
    items.append(f'p{i}_{j} "\\n"' if key in required else f'(p{i}_{j} "\\n")?')
  return [f"params{i}: {' '.join(items) or _q('')}"] + rules


def tool_call_grammar(tools: Sequence[dict], name: str | None, parallel: bool, dsml_id: int | None) -> GrammarSpec:
  """The grammar of the rest of a forced tool-call block: any offered tool (name None: tool_choice
  "required"; several calls unless parallel is false) or the named one (its invoke already opened).
  dsml_id: the DSML marker's token id when it is one token (matched as that token), else None (text)."""
  names = [t["function"]["name"] for t in tools]
  end_invoke, end_calls = f"</{fmt.DSML}invoke>", "\n" + fmt.CALLS_CLOSE
  rules = [f"d: <[{dsml_id}]>" if dsml_id is not None else f"d: {_q(fmt.DSML)}", 'TEXT: /[^<]*/']
  for i, tool in enumerate(tools):
    rules += _invoke_body(i, tool)
  if name is not None:
    start = f"start: params{names.index(name)} {_seq(end_invoke + end_calls)}"
  else:
    for i, n in enumerate(names):
      head = fmt.INVOKE_TEMPLATE.format(name=n, parameters="\0").split("\0")[0]
      rules.append(f"inv{i}: {_seq(head)} params{i} {_seq(end_invoke)}")
    rules.append("invoke: " + " | ".join(f"inv{i}" for i in range(len(names))))
    start = f"start: invoke {'(' + _q(chr(10)) + ' invoke)* ' if parallel else ''}{_seq(end_calls)}"
  return GrammarSpec("lark", "\n".join([start, *rules]), "tool_choice")


__all__ = ["tool_call_grammar"]
