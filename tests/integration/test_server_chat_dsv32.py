"""DeepSeek-V3.2 chat end to end through the real server, parser and `openai` client (MaxText/server/chat.py):
thinking on and off, streamed and not, a tool call parsed into tool_calls, the tool's result sent back,
a final answer; tool_choice and parallel_tool_calls; bad tools and tool messages as OpenAI 400s naming
the field. The engine is a stand-in (the real Scheduler; each step emits the next token of a fixed
completion chosen from the prompt's text) until a fine-tuned model really calls tools."""

import contextlib
import json
import os
import time

import httpx
import openai
import pytest

from MaxText.data import chat_dsv32 as fmt
from MaxText.data import chat_template
from MaxText.data.tokenizer import load_tokenizer
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.in_process import serve_in_thread
from MaxText.server.protocol import Texts
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import SchedulerEngine

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
D = fmt.DSML
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
INVOKE = (f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
          f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>')
ARGS = {"city": "Paris", "days": 2}


def script(prompt: str) -> str:
  """The stand-in model's completion for a prompt (the text after it, ending in EOS)."""
  think = "I should answer.</think>" if prompt.endswith(fmt.THINK_START) else ""
  two_calls = f"{INVOKE}\n{INVOKE}\n{fmt.CALLS_CLOSE}{fmt.EOS}"
  if prompt.endswith(f"{fmt.CALLS_OPEN}\n"):  # tool_choice="required" opened the block
    return two_calls
  if prompt.endswith(INVOKE.split("\n")[0] + "\n"):  # tool_choice named get_weather: its invoke is open
    return two_calls.split("\n", 1)[1]
  if "</function_results>" in prompt[-40:]:
    return f"{think}It is sunny in Paris.{fmt.EOS}"
  if "## Tools" in prompt and "<｜User｜>Weather" in prompt:
    return f"{think}Let me check.\n\n{fmt.CALLS_OPEN}\n{INVOKE}\n{fmt.CALLS_CLOSE}{fmt.EOS}"
  return f"{think}Hello!{fmt.EOS}"


class StandInEngine(SchedulerEngine):
  """The model's stand-in: a request's tokens are those of script(its prompt's text)."""

  def __init__(self, tok):
    self.tok, self.scripts = tok, {}
    super().__init__(num_pages=512, page_size=16, max_num_seqs=4, max_num_tokens=1024, chunk=1024, max_length=4096,
                     eos_id=tok.eos_id)

  def add_request(self, prompt, params):
    request = super().add_request(prompt, params)
    self.scripts[id(request)] = self.tok.encode(script(self.tok.decode(prompt)))
    return request

  def next_tokens(self, rows):
    return [self.scripts[id(r.request)][len(r.request.output)] for r in rows]


@pytest.fixture(scope="module")
def served():
  """(base url, tokenizer): the app on a free port with the stand-in engine and the test tokenizer (no
  chat template, so chat_encoding=auto picks DeepSeek-V3.2's format)."""
  cfg = make_config(tokenizer_type="hf", tokenizer_path=TOKENIZER, max_target_length=4096, serve_page_size=16)
  tok = load_tokenizer(cfg)
  texts = Texts(tok, add_bos=True, vocab_size=512, chat_template=None, chat_template_source="none",
                special_tokens={}, chat_encoding=chat_template.resolve_encoding(cfg.chat_encoding, False, True))
  engine = EngineThread(lambda: contextlib.nullcontext(StandInEngine(tok)), max_waiting=8, log=lambda line: None)
  with serve_in_thread(build_app(Server(cfg, texts, engine, "dsv32-stand-in"))) as (url, _):
    deadline = time.monotonic() + 30
    while not engine.ready and time.monotonic() < deadline:
      time.sleep(0.02)
    yield url, tok


def _client(url):
  return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def _stream(client, **kw):
  """A streamed chat reply folded: (reasoning, content, tool calls by index, finish_reason, chunks)."""
  reasoning, content, calls, reason, chunks = "", "", {}, None, []
  for chunk in client.chat.completions.create(model="dsv32-stand-in", stream=True, **kw):
    chunks.append(chunk)
    delta = chunk.choices[0].delta
    reasoning += getattr(delta, "reasoning_content", None) or ""
    content += delta.content or ""
    for c in delta.tool_calls or []:
      calls.setdefault(c.index, {"index": c.index, "id": c.id, "name": c.function.name, "arguments": ""})
      calls[c.index]["arguments"] += c.function.arguments or ""
    reason = chunk.choices[0].finish_reason or reason
  return reasoning, content, [calls[i] for i in sorted(calls)], reason, chunks


def test_thinking_on_and_off_plain_and_streamed(served):
  url, tok = served
  client = _client(url)
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  r = client.chat.completions.create(model="dsv32-stand-in", messages=msgs, extra_body={"return_token_ids": True})
  assert r.model_dump()["prompt_token_ids"] == tok.encode(f"{fmt.BOS}Be brief.{fmt.USER}Hi{fmt.ASSISTANT}</think>")
  m = r.choices[0].message
  assert (m.content, getattr(m, "reasoning_content", None), r.choices[0].finish_reason) == ("Hello!", None, "stop")
  on = {"chat_template_kwargs": {"thinking": True}}
  r = client.chat.completions.create(model="dsv32-stand-in", messages=msgs, extra_body=on)
  assert (r.choices[0].message.content, r.choices[0].message.reasoning_content) == ("Hello!", "I should answer.")
  reasoning, content, calls, reason, chunks = _stream(client, messages=msgs, extra_body=on)
  assert (reasoning, content, calls, reason) == ("I should answer.", "Hello!", [], "stop")
  assert chunks[0].choices[0].delta.role == "assistant"
  assert not any("<" in (c.choices[0].delta.content or "") for c in chunks)  # no piece of </think> or EOS sent
  _, content, _, _, _ = _stream(client, messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
  assert content == "Hello!"


@pytest.mark.parametrize("thinking", [False, True])
def test_a_tool_call_its_result_sent_back_and_a_final_answer(served, thinking):
  client = _client(served[0])
  kw = {"tools": TOOLS, "extra_body": {"chat_template_kwargs": {"thinking": thinking}}}
  msgs = [{"role": "user", "content": "Weather in Paris?"}]
  r = client.chat.completions.create(model="dsv32-stand-in", messages=msgs, **kw)
  choice = r.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
  (call,) = choice.message.tool_calls
  assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
  assert json.loads(call.function.arguments) == ARGS
  reasoning, content, calls, reason, _ = _stream(client, messages=msgs, **kw)
  assert (content, reason, [(c["name"], json.loads(c["arguments"])) for c in calls]) == (
      "Let me check.", "tool_calls", [("get_weather", ARGS)])
  assert reasoning == ("I should answer." if thinking else "")
  msgs += [choice.message.model_dump(exclude_none=True),
           {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny"})}]
  final = client.chat.completions.create(model="dsv32-stand-in", messages=msgs, **kw).choices[0]
  assert (final.message.content, final.message.tool_calls, final.finish_reason) == (
      "It is sunny in Paris.", None, "stop")


def test_a_reply_cut_by_max_tokens_inside_a_tool_call_is_content_streamed_or_not(served):
  client = _client(served[0])
  kw = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 40}
  r = client.chat.completions.create(model="dsv32-stand-in", **kw).choices[0]
  assert r.finish_reason == "length" and not r.message.tool_calls
  assert r.message.content.startswith(f"Let me check.\n\n{fmt.CALLS_OPEN}\n<{D}invoke")
  _, content, calls, reason, _ = _stream(client, **kw)  # what the parser held back comes out at the end
  assert (content, calls, reason) == (r.message.content, [], "length")


def test_tool_choice_forces_a_call_and_parallel_tool_calls_false_keeps_the_first(served):
  client = _client(served[0])
  msgs = [{"role": "user", "content": "Hi"}]
  named = {"type": "function", "function": {"name": "get_weather"}}
  for choice, parallel, n in [("required", True, 2), (named, False, 1)]:
    r = client.chat.completions.create(model="dsv32-stand-in", messages=msgs, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=parallel)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == n and all(json.loads(c.function.arguments) == ARGS for c in calls)
    _, content, streamed, reason, _ = _stream(client, messages=msgs, tools=TOOLS, tool_choice=choice,
                                              parallel_tool_calls=parallel)
    assert (content, len(streamed), reason) == ("", n, "tool_calls")
    assert [c["index"] for c in streamed] == list(range(n))
  assert client.chat.completions.create(model="dsv32-stand-in", messages=msgs, tools=TOOLS,
                                        tool_choice="none").choices[0].message.content == "Hello!"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_tools_and_tool_messages_are_openai_400s_naming_the_field(served, body, param):
  r = httpx.post(f"{served[0]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body},
                 timeout=30)
  err = r.json()["error"]
  assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


def test_auto_picks_the_jinja_template_when_there_is_one_and_deepseek_v32_needs_a_tokenizer():
  from MaxText.config.types import ConfigError
  assert [chat_template.resolve_encoding("auto", t, k) for t, k in [(True, True), (False, True), (False, False)]] == [
      "jinja", "deepseek_v32", "jinja"]
  assert chat_template.resolve_encoding("jinja", False, True) == "jinja"
  with pytest.raises(ConfigError, match="chat_encoding=deepseek_v32 needs tokenizer_path"):
    chat_template.resolve_encoding("deepseek_v32", False, False)


def test_chat_thinking_is_the_mode_of_a_request_that_does_not_say():
  from MaxText.server.chat import chat_turn
  from MaxText.server.protocol import ChatRequest
  tok = load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=TOKENIZER))
  hi = [{"role": "user", "content": "hi"}]
  for default in (False, True):
    texts = Texts(tok, add_bos=True, vocab_size=512, chat_template=None, chat_template_source="none",
                  special_tokens={}, chat_encoding="deepseek_v32", thinking=default)
    turn = chat_turn(texts, ChatRequest(messages=hi))
    assert turn.thinking == default and tok.decode(turn.prompt).endswith(fmt.THINK_START if default else fmt.THINK_END)
    said = chat_turn(texts, ChatRequest(messages=hi, chat_template_kwargs={"thinking": not default}))
    assert said.thinking == (not default)  # the request's word wins


def test_a_forced_tool_call_is_submitted_under_the_tools_grammar_and_auto_under_none():
  from MaxText.inference.grammar import Grammars
  cfg = make_config(tokenizer_type="hf", tokenizer_path=TOKENIZER, max_target_length=4096, serve_page_size=16)
  tok = load_tokenizer(cfg)
  texts = Texts(tok, add_bos=True, vocab_size=512, chat_template=None, chat_template_source="none",
                special_tokens={}, chat_encoding="deepseek_v32")
  stand_in = StandInEngine(tok)
  engine = EngineThread(lambda: contextlib.nullcontext(stand_in), max_waiting=8, log=lambda line: None)
  server = Server(cfg, texts, engine, "dsv32-stand-in", grammars=Grammars.for_tokenizer(tok, 512))
  with serve_in_thread(build_app(server)) as (url, _):
    deadline = time.monotonic() + 30
    while not engine.ready and time.monotonic() < deadline:
      time.sleep(0.02)
    msgs = [{"role": "user", "content": "Hi"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
      httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": msgs, "tools": TOOLS,
                                                                  "tool_choice": choice, "max_tokens": 4})
  kinds = [r.params.grammar.kind if r.params.grammar else None for r in stand_in.requests]
  assert kinds == ["lark", "lark", None]
  assert 'name=\\"get_weather\\"' in stand_in.requests[0].params.grammar.source
