"""A /v1/chat/completions request as a turn: its prompt ids and the parser of its reply, in the
tokenizer's jinja template or in DeepSeek-V3.2's own format (MaxText/data/chat_dsv32.py).

    turn = chat_turn(texts, body)             # ApiError 400 naming the field for bad messages or tools
    delta = turn.delta(piece_text)            # OpenAI's streamed delta fields for a piece of the reply
    message = turn.message(reply_text)        # OpenAI's message: content, reasoning_content, tool_calls

DeepSeek-V3.2 per request: `chat_template_kwargs: {"thinking": true}` (or "enable_thinking"; default
chat_thinking, the mode SFT and RL default to) ends the prompt with <think> and the reply's text up to </think> is `reasoning_content`; `tools` go into the
system prompt and DSML blocks in the reply become `tool_calls` (finish_reason "tool_calls");
`tool_choice`: "auto", "none" (no tools in the prompt), "required" or {"type": "function",
"function": {"name": ...}} (the reply is started with the function_calls block, or that function's
invoke, and the rest of the block is held by a grammar to DSML calls of the offered tools whose
parameters match their schemas (server/tool_grammar.py), so a tool is called; thinking is off for such a turn); `parallel_tool_calls: false` keeps the
first call; `response_format` goes into the system prompt. The EOS marker is a stop token. A request with a
grammar (response_format json_object / json_schema, structured_outputs: server/structured.py) runs with
thinking off, so the grammar constrains the whole reply, its content; with tool_choice forcing a call it is a 400.

vLLM's rendering fields, both formats: `continue_final_message` leaves the last message open (the reply continues
it: the jinja text cut after its content, as transformers does; in V3.2's format an assistant message without its
<｜end▁of▁sentence｜>); `add_special_tokens` puts BOS before the template's text (never a second one); `echo` starts
the reply's content with the last message's when that message is the assistant's; `include_reasoning: false` drops
reasoning_content; `reasoning_effort` turns thinking on ("none": off) where chat_template_kwargs does not say.
Jinja only: `add_generation_prompt` (V3.2's format writes <｜Assistant｜> as part of each user turn, as the release's
encoder and vLLM's DeepSeek-V3.2 renderer do, so there it changes nothing), `documents` and chat_template_kwargs
as the template's variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from MaxText.data import chat_dsv32 as fmt
from MaxText.data.chat_dsv32_stream import CompletionParser, Delta
from MaxText.server.protocol import ApiError, ChatRequest, Texts
from MaxText.server.structured import grammar_spec
from MaxText.server.tool_grammar import ForcedCall


class _PlainParser:
  """The jinja path's reply: all content."""

  def feed(self, text: str) -> Delta:
    return Delta(content=text)

  def finish(self) -> Delta:
    return Delta()


@dataclasses.dataclass
class ChatTurn:
  """One request's prompt and reply parser. Tool calls are numbered as sent (index 0, 1, ...)."""
  prompt: list[int]
  parser: Any  # CompletionParser or _PlainParser: feed(text) -> Delta, finish() -> Delta
  stop_ids: tuple[int, ...] = ()
  thinking: bool = False
  parallel_tool_calls: bool = True
  calls: int = 0
  grammar: Any = None  # a forced tool call's ForcedCall (server/tool_grammar.py: .spec(max_tokens)), or None
  include_reasoning: bool = True
  echo: str = ""  # the content the reply starts with (echo: the last message's); sent with the first delta

  def _calls(self, delta: Delta) -> list[dict]:
    calls = delta.tool_calls if self.parallel_tool_calls else delta.tool_calls[:max(0, 1 - self.calls)]
    out = [{"index": self.calls + k, **c} for k, c in enumerate(calls)]
    self.calls += len(out)
    return out

  def delta(self, text: str, final: bool) -> dict:
    """OpenAI's delta fields for the next piece of the reply ({} while the parser holds it back)."""
    d = self.parser.feed(text)
    if final:
      end = self.parser.finish()
      d = Delta(d.reasoning_content + end.reasoning_content, d.content + end.content, d.tool_calls + end.tool_calls)
    out: dict = {}
    if d.reasoning_content and self.include_reasoning:
      out["reasoning_content"] = d.reasoning_content
    content, self.echo = self.echo + d.content, ""
    if content:
      out["content"] = content
    if calls := self._calls(d):
      out["tool_calls"] = calls
    return out

  def message(self, text: str) -> dict:
    """The whole reply as OpenAI's message (content null when the reply is only tool calls)."""
    d = self.delta(text, final=True)
    calls = [{k: v for k, v in c.items() if k != "index"} for c in d.get("tool_calls", [])]
    msg: dict = {"role": "assistant", "content": d.get("content", "") if not calls or d.get("content") else None}
    if self.thinking and self.include_reasoning:
      msg["reasoning_content"] = d.get("reasoning_content", "")
    if calls:
      msg["tool_calls"] = calls
    return msg

  def finish_reason(self, reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" and self.calls else reason


def chat_turn(texts: Texts, body: ChatRequest) -> ChatTurn:
  last = body.messages[-1] if body.messages else None
  echo = last.text() if body.echo and last is not None and last.role == "assistant" else ""
  special = bool(body.add_special_tokens)
  kwargs = body.chat_template_kwargs or {}
  thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
  if thinking is None:
    thinking = texts.thinking if body.reasoning_effort is None else body.reasoning_effort != "none"
  if texts.chat_encoding != "deepseek_v32":
    reserved = ("messages", "add_generation_prompt", *texts.special_tokens)
    variables = {k: v for k, v in kwargs.items() if k not in reserved} | {
        "documents": body.documents, "continue_final_message": body.continue_final_message,
        "reasoning_effort": body.reasoning_effort} | ({"enable_thinking": thinking} if body.reasoning_effort else {})
    prompt = texts.chat_prompt(body.messages, generation_prompt=body.generation_prompt,
                               continue_final=body.continue_final_message, special=special, kwargs=variables)
    return ChatTurn(prompt, _PlainParser(), echo=echo)
  constrained = grammar_spec(body) is not None  # the grammar is the reply's: no thinking before it
  thinking = bool(thinking) and not constrained
  try:
    tools = fmt.check_tools(body.tools)
    forced = _forced_start(body.tool_choice, tools)
    if forced and constrained:
      raise fmt.ChatFormatError(f"tool_choice={body.tool_choice!r} forces a tool call, which a response_format "
                                "or structured_outputs grammar would forbid: send one of them", "tool_choice")
    if forced and body.continue_final_message:
      raise fmt.ChatFormatError(f"tool_choice={body.tool_choice!r} starts a new reply with a tool call: "
                                "continue_final_message continues the last one; send one of them", "tool_choice")
    text = fmt.render([m.as_dict() for m in body.messages], thinking=thinking and forced is None,
                      tools=tools if body.tool_choice != "none" else None, response_format=body.response_format)
    if body.continue_final_message:
      text = _open_final(text, last)
  except fmt.ChatFormatError as e:
    raise ApiError.bad_field(e) from None
  parser = CompletionParser(thinking=text.endswith(fmt.THINK_START))
  if forced:
    parser.feed(forced)  # the start of a block: held, sent with the rest of it
  eos = texts.tokenizer.encode(fmt.EOS) if texts.tokenizer is not None else []
  grammar = None
  if forced and texts.tokenizer is not None:
    dsml = texts.tokenizer.encode(fmt.DSML)
    name = None if body.tool_choice == "required" else body.tool_choice["function"]["name"]
    try:
      grammar = ForcedCall(tools, name, body.parallel_tool_calls, dsml[0] if len(dsml) == 1 else None)
    except fmt.ChatFormatError as e:
      raise ApiError.bad_field(e) from None
  return ChatTurn(texts.encode(text + (forced or ""), bos=None if special else False), parser,
                  tuple(eos) if len(eos) == 1 else (), thinking=text.endswith(fmt.THINK_START),
                  parallel_tool_calls=body.parallel_tool_calls, grammar=grammar,
                  include_reasoning=body.include_reasoning, echo=echo)


def _open_final(text: str, last) -> str:
  """V3.2's prompt with its last message left open: an assistant message (without tool calls) minus its EOS."""
  if last.role != "assistant" or getattr(last, "tool_calls", None) or not text.endswith(fmt.EOS):
    raise fmt.ChatFormatError("continue_final_message needs the last message to be the assistant's, without "
                              f"tool_calls (it is {last.role!r})", "continue_final_message")
  return text[:-len(fmt.EOS)]


def _forced_start(tool_choice: Any, tools: list[dict]) -> str | None:
  """The text a reply must start with for tool_choice (None: the model chooses)."""
  if tool_choice in (None, "auto", "none"):
    return None
  names = [t["function"]["name"] for t in tools]
  if not names:
    raise fmt.ChatFormatError(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
  start = fmt.CALLS_SEP + fmt.CALLS_OPEN + "\n"
  if tool_choice == "required":
    return start
  name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
  if name is None:
    raise fmt.ChatFormatError(f"tool_choice={tool_choice!r} is not \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
  if name not in names:
    raise fmt.ChatFormatError(f"tool_choice names function {name!r}, which is not in tools ({names})", "tool_choice")
  return start + fmt.INVOKE_TEMPLATE.format(name=name, parameters="").split("\n")[0] + "\n"
