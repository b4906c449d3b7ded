"""DeepSeek-V3.2's conversation format: OpenAI-style messages -> prompt text, and a completion's text ->
reasoning, content and tool calls. The release ships no jinja chat template; this is its format
(the release's `encoding/encoding_dsv32.py`, as vLLM and SGLang copy it), written as templates and
short rules. Text in, text out: the caller tokenizes (the V3.2 tokenizer holds every marker below as
one added token). The server (MaxText/server/) and the SFT data both render with it.

    text = render(messages, thinking=True, tools=tools)          # the prompt, ends <think> or </think>
    msg = parse_completion(completion_text, thinking=True)       # ParsedMessage(reasoning, content, tool_calls)

The format (every string below is a constant of this module):
    BOS system-content ["\\n\\n" TOOLS block] ["\\n\\n" RESPONSE_FORMAT block]   (no role token)
    <｜User｜>{content}<｜Assistant｜>  then <think> (thinking mode, last user turn) or </think>
    assistant: [{reasoning}</think>]{content}["\\n\\n" DSML function_calls block]<｜end▁of▁sentence｜>
    tool results: "\\n\\n<function_results>" ("\\n<result>{content}</result>")* "\\n</function_results>"
                  then "\\n\\n<think>" or "\\n\\n</think>" (no user token)
    developer: a user turn whose content is [tools] [response format] "\\n\\n# The user's message is: {content}"

Invariants: an assistant's reasoning is rendered only after the last user (or developer) turn in
thinking mode, so a later user message drops earlier reasoning while a tool-call loop keeps it;
parse_completion never raises: a malformed or truncated tool-call block comes back, character for
character, as content; parse(render(assistant message)) == the message. The incremental parser is
chat_dsv32_stream.CompletionParser (the same result at every split of the text).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable, Sequence

from MaxText.runtime.cli import FieldError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)  # one token each in V3.2's vocabulary

CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"
CALLS_SEP = "\n\n"  # between an assistant's content and its function_calls block
USER_TEMPLATE = USER + "{content}" + ASSISTANT
DEVELOPER_MESSAGE_TEMPLATE = "\n\n# The user's message is: {content}"
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
INVOKE_TEMPLATE = f'<{DSML}invoke name="{{name}}">\n{{parameters}}\n</{DSML}invoke>'
PARAMETER_TEMPLATE = f'<{DSML}parameter name="{{name}}" string="{{is_string}}">{{value}}</{DSML}parameter>'
CALLS_TEMPLATE = CALLS_OPEN + "\n{invokes}\n" + CALLS_CLOSE
RESULTS_OPEN = "\n\n<function_results>"
RESULT_TEMPLATE = "\n<result>{content}</result>"
RESULTS_CLOSE = "\n</function_results>"
TOOLS_TEMPLATE = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
{think_start}...thinking about results{think_end}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

USER_ROLES = ("user", "developer")


class ChatFormatError(FieldError):
  """Messages or tools the format cannot render; `field` names the bad one (e.g. messages[3].tool_call_id)."""


@dataclasses.dataclass
class ParsedMessage:
  """An assistant reply: reasoning (None outside thinking mode), content, and OpenAI-shaped tool calls
  ({"id", "type": "function", "function": {"name", "arguments": a JSON object as a string}})."""
  reasoning_content: str | None
  content: str
  tool_calls: list[dict]


def _json(value: Any) -> str:
  return json.dumps(value, ensure_ascii=False)


def new_call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- rendering


def render_tools(tools: Sequence[dict]) -> str:
  """The "## Tools" block: each function's JSON schema on its own line inside <functions>."""
  return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END,
                               schemas="\n".join(_json(t["function"]) for t in tools))


def check_tools(tools: Sequence[Any] | None) -> list[dict]:
  """OpenAI's `tools` ([{"type": "function", "function": {"name", "description"?, "parameters"?}}]),
  checked; a bad one is a ChatFormatError naming tools[i].<field>."""
  out = []
  for i, tool in enumerate(tools or []):
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
      raise ChatFormatError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
      raise ChatFormatError(f"{where}.function must be an object with a name", f"{where}.function")
    if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", fn["name"]):
      raise ChatFormatError(f"{where}.function.name must be 1-64 letters, digits, '_', '.', ':' or '-', "
                            f"got {fn.get('name')!r}", f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
      raise ChatFormatError(f"{where}.function.parameters must be a JSON schema object "
                            "({\"type\": \"object\", \"properties\": {...}})", f"{where}.function.parameters")
    if "description" in fn and not isinstance(fn["description"], str):
      raise ChatFormatError(f"{where}.function.description must be a string", f"{where}.function.description")
    out.append({"type": "function", "function": fn})
  return out


def _system_extras(tools: Sequence[dict] | None, response_format: dict | None) -> str:
  out = "\n\n" + render_tools(tools) if tools else ""
  if response_format and response_format.get("type", "text") != "text":
    out += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_json(response_format))
  return out


def _arguments(call: dict, where: str) -> dict:
  args = call.get("function", {}).get("arguments", "{}")
  try:
    args = json.loads(args) if isinstance(args, str) else args
  except ValueError:
    raise ChatFormatError(f"{where}.function.arguments is not JSON: {args[:80]!r}", f"{where}.function.arguments")
  if not isinstance(args, dict):
    raise ChatFormatError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
  return args


def render_tool_calls(calls: Sequence[dict], where: str = "tool_calls") -> str:
  """An assistant's tool calls as DSML: strings raw (string="true"), other values as JSON."""
  invokes = []
  for j, call in enumerate(calls):
    name = call.get("function", {}).get("name")
    if not isinstance(name, str) or not name:
      raise ChatFormatError(f"{where}[{j}].function.name is missing", f"{where}[{j}].function.name")
    params = [PARAMETER_TEMPLATE.format(name=k, is_string="true" if isinstance(v, str) else "false",
                                        value=v if isinstance(v, str) else _json(v))
              for k, v in _arguments(call, f"{where}[{j}]").items()]
    invokes.append(INVOKE_TEMPLATE.format(name=name, parameters="\n".join(params)))
  return CALLS_TEMPLATE.format(invokes="\n".join(invokes))


def _text(content: Any) -> str:
  if isinstance(content, list):  # OpenAI's content parts: the text parts, joined
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
  return "" if content is None else str(content)


def _user_turn(content: str, thinking: bool) -> str:
  """A user turn and the generation prompt's mode: <think> (thinking, the last user turn) or </think>."""
  return USER_TEMPLATE.format(content=content) + (THINK_START if thinking else THINK_END)


def _tool_turn_end(thinking: bool) -> str:
  return "\n\n" + (THINK_START if thinking else THINK_END)


def render_pieces(messages: Sequence[dict], *, thinking: bool, tools: Sequence[dict] | None = None,
                  response_format: dict | None = None, bos: bool = True) -> list[tuple[str, str]]:
  """(role, text) per message, in order: render() joins them; SFT weighs the assistant's pieces.
  `tools` and `response_format` (the request's) go into the first system message (an empty one
  is put first when there is none). Raises ChatFormatError naming a bad message."""
  messages = list(messages)
  extras = _system_extras(tools, response_format)
  inserted = int(bool(extras) and not (messages and messages[0].get("role") == "system"))
  if inserted:
    messages.insert(0, {"role": "system", "content": ""})
  last_user = max((i for i, m in enumerate(messages) if m.get("role") in USER_ROLES), default=-1)
  pieces: list[tuple[str, str]] = [("bos", BOS)] if bos else []
  calls: list[dict] = []  # the calls tool messages may answer: the assistant message right before them
  answered = 0
  for i, m in enumerate(messages):
    role, text = m.get("role"), _text(m.get("content"))
    where = f"messages[{i - inserted}]"  # as the caller numbers them
    if role != "tool":
      calls, answered = list(m.get("tool_calls") or []) if role == "assistant" else [], 0
    if role == "system":
      pieces.append((role, text + (extras if i == 0 else "")))
    elif role == "user":
      pieces.append((role, _user_turn(text, thinking and i == last_user)))
    elif role == "developer":
      body = _system_extras(m.get("tools"), m.get("response_format")) + DEVELOPER_MESSAGE_TEMPLATE.format(content=text)
      pieces.append((role, _user_turn(body, thinking and i == last_user)))
    elif role == "assistant":
      reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
      head = reasoning + THINK_END if thinking and i > last_user else ""
      tail = CALLS_SEP + render_tool_calls(calls, f"{where}.tool_calls") if calls else ""
      pieces.append((role, head + text + tail + EOS))
    elif role == "tool":
      pieces.append((role, _render_tool_result(m, text, calls, answered, where)))
      answered += 1
      nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
      if nxt != "tool":
        pieces[-1] = (role, pieces[-1][1] + RESULTS_CLOSE + _tool_turn_end(thinking and i > last_user))
    else:
      raise ChatFormatError(f"{where}.role={role!r} is not one of system, user, developer, assistant, tool",
                            f"{where}.role")
  return pieces


def _render_tool_result(m: dict, text: str, calls: list[dict], answered: int, where: str) -> str:
  """One <result>; the first of a run opens <function_results>. The message must answer a call of
  the assistant message before it (by tool_call_id when it gives one)."""
  if answered >= len(calls):
    raise ChatFormatError(f"{where} is a tool result with no matching tool call: the assistant message before "
                          f"it made {len(calls)} call(s)", f"{where}.tool_call_id")
  call_id = m.get("tool_call_id")
  if call_id is not None and call_id not in [c.get("id") for c in calls]:
    raise ChatFormatError(f"{where}.tool_call_id={call_id!r} matches no tool call of the assistant message before it "
                          f"(ids: {[c.get('id') for c in calls]})", f"{where}.tool_call_id")
  return (RESULTS_OPEN if answered == 0 else "") + RESULT_TEMPLATE.format(content=text)


def render(messages: Sequence[dict], *, thinking: bool, tools: Sequence[dict] | None = None,
           response_format: dict | None = None, bos: bool = True) -> str:
  """The whole conversation as V3.2's prompt text. Ending on a user or tool turn, it ends with the
  generation prompt (<think> in thinking mode, </think> otherwise)."""
  return "".join(text for _, text in render_pieces(messages, thinking=thinking, tools=tools,
                                                   response_format=response_format, bos=bos))


# ---------------------------------------------------------------- parsing


_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"<>]*)">\n?(.*?)</{DSML}invoke>', re.S)
_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"<>]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def parse_tool_block(body: str, new_id: Callable[[], str] = new_call_id) -> list[dict] | None:
  """The invokes between <function_calls> and </function_calls> -> OpenAI tool calls, or None when
  anything in it is malformed (unknown text, a duplicate parameter, a non-string value that is not JSON)."""
  calls, pos = [], 0
  while (m := _INVOKE.match(body, pos)) is not None:
    args, inner, at = {}, m.group(2), 0
    while (p := _PARAMETER.match(inner, at)) is not None:
      name, is_string, value = p.groups()
      if name in args:
        return None
      if is_string == "true":
        args[name] = value
      else:
        try:
          args[name] = json.loads(value)
        except ValueError:
          return None
      at = p.end()
    if inner[at:].strip():
      return None
    calls.append({"id": new_id(), "type": "function", "function": {"name": m.group(1), "arguments": _json(args)}})
    pos = m.end()
  return calls if calls and not body[pos:].strip() else None


def parse_completion(text: str, *, thinking: bool, new_id: Callable[[], str] = new_call_id) -> ParsedMessage:
  """A completion (the text after the prompt) -> its parts. Thinking mode: the text up to the first
  </think> is reasoning (all of it if none comes). Then content, with each well-formed
  function_calls block (and the "\\n\\n" before it) taken out as tool calls; from the first malformed
  or unclosed block on, everything is content. The text ends at EOS (a completion has nothing after it)."""
  text = text.split(EOS, 1)[0]
  reasoning = None
  if thinking:
    reasoning, _, text = text.partition(THINK_END)
  content, calls = "", []
  while (i := text.find(CALLS_OPEN)) >= 0:
    j = text.find(CALLS_CLOSE, i)
    block = parse_tool_block(text[i + len(CALLS_OPEN):j], new_id) if j >= 0 else None
    if block is None:
      break
    before = text[:i]
    content += before[:-len(CALLS_SEP)] if before.endswith(CALLS_SEP) else before
    calls += block
    text = text[j + len(CALLS_CLOSE):]
  return ParsedMessage(reasoning, content + text, calls)
