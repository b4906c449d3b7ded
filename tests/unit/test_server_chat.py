"""The chat side of the server without a model (MaxText/server/chat.py, server/logprobs.py, app.py's
/tokenize): the reply parser's thinking mode is the rendered prompt's (tool_choice forcing a call turns
thinking off whatever the request asked), /tokenize of a chat request is exactly the prompt
/v1/chat/completions runs (tools, chat_template_kwargs and the grammar fields included), and chat
top_logprobs come most likely first."""

import contextlib
import os

import pytest
from fastapi.testclient import TestClient

from MaxText.data import chat_dsv32 as fmt
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import Grammars
from MaxText.inference.logprobs import Logprob
from MaxText.server.app import Server, build_app
from MaxText.server.chat import chat_turn
from MaxText.server.engine_thread import EngineThread
from MaxText.server.logprobs import chat_logprobs
from MaxText.server.protocol import ChatRequest, Texts
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "3+4?"}]


@pytest.fixture(scope="module")
def texts():
  tok = load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=os.path.join(REPO_ROOT, "tests", "data",
                                                                                    "tokenizer.json")))
  return Texts(tok, add_bos=False, vocab_size=512, chat_template=None, chat_template_source="none", special_tokens={},
               chat_encoding="deepseek_v32")


@pytest.mark.parametrize("tool_choice, thinking", [("auto", True), ("required", False),
                                                   ({"type": "function", "function": {"name": "add"}}, False)])
def test_the_reply_parser_thinks_exactly_when_the_rendered_prompt_does(texts, tool_choice, thinking):
  """thinking asked for; a forced tool call starts the reply with its block, so the prompt ends </think>:
  the reply is then content and calls, never reasoning."""
  turn = chat_turn(texts, ChatRequest(messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                      chat_template_kwargs={"thinking": True}))
  prompt = texts.tokenizer.decode(turn.prompt)
  assert turn.thinking == thinking and (fmt.ASSISTANT + fmt.THINK_START in prompt) == thinking
  invoke = "" if isinstance(tool_choice, dict) else f'<{fmt.DSML}invoke name="add">\n'  # a named call is started
  msg = turn.message("7" if thinking else f"{invoke}</{fmt.DSML}invoke>\n{fmt.CALLS_CLOSE}")
  if thinking:
    assert msg["reasoning_content"] == "7" and msg["content"] == ""  # all reasoning until </think>
  else:
    assert "reasoning_content" not in msg and msg["tool_calls"][0]["function"]["name"] == "add"


def test_tokenize_of_a_chat_request_is_the_prompt_the_chat_endpoint_runs(texts):
  """vLLM's /tokenize takes the chat request's fields: the tools block, thinking's <think>, a grammar's
  thinking off; its ids equal /v1/chat/completions' prompt_token_ids (return_token_ids)."""
  eng = ScriptedEngine(token_base=300)
  eng._sizes.update(num_pages=256, max_length=1024, max_num_tokens=1024, chunk=1024)  # room for a tools block
  eng.reset()
  engine = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
  bodies = [{"messages": USER, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}},
            {"messages": USER, "tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"thinking": True}},
            {"messages": USER, "response_format": {"type": "json_object"}, "chat_template_kwargs": {"thinking": True}},
            {"messages": USER}]
  server = Server(make_config(max_target_length=1024, max_prefill_length=1024), texts, engine, "tiny",
                  grammars=Grammars.for_tokenizer(texts.tokenizer, 512))
  with TestClient(build_app(server)) as client:
    seen = []
    for body in bodies:
      tokens = client.post("/tokenize", json=body).json()["tokens"]
      ran = client.post("/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}).json()
      assert "prompt_token_ids" in ran, ran
      assert tokens == ran["prompt_token_ids"], body
      seen.append(texts.tokenizer.decode(tokens))
    bad = client.post("/tokenize", json={"messages": USER, "tools": [{"type": "function", "function": {}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name"
  assert "## Tools" in seen[0] and seen[0].endswith(fmt.THINK_START)  # tools and thinking rendered
  assert "## Tools" not in seen[1] and seen[2].endswith(fmt.THINK_END) and "## Response Format" in seen[2]
  assert seen[3].endswith(fmt.THINK_END) and "## Tools" not in seen[3]


def test_chat_top_logprobs_come_most_likely_first(texts):
  entries = [Logprob(-0.5, 2, [(7, -0.1), (9, -0.5), (8, -2.0)]), None, Logprob(-0.2, 1, [(5, -0.2)])]
  out = chat_logprobs(texts, [9, 4, 5], entries)
  assert [e["logprob"] for e in out] == [-0.5, -0.2]  # a position without a logprob is left out
  assert [t["logprob"] for t in out[0]["top_logprobs"]] == [-0.1, -0.5, -2.0]
  assert [t["token"] for t in out[0]["top_logprobs"]] == [texts.tokenizer.decode([i]) for i in (7, 9, 8)]
  assert out[0]["bytes"] == list(texts.tokenizer.decode([9]).encode("utf-8"))


def test_v32_rendering_fields_continue_echo_reasoning_effort_and_include_reasoning(texts):
  """DeepSeek-V3.2's format: continue_final_message leaves the assistant message open (no EOS: the reply continues
  its content, as content); echo starts the reply with it; reasoning_effort turns thinking on ("none" off) where
  chat_template_kwargs does not say; include_reasoning false drops reasoning_content; add_special_tokens adds no
  second BOS; a last message that is not the assistant's cannot be continued (400 naming the field)."""
  dec = texts.tokenizer.decode
  open_ = USER + [{"role": "assistant", "content": "The answer is"}]
  turn = chat_turn(texts, ChatRequest(messages=open_, continue_final_message=True, echo=True))
  prompt = dec(turn.prompt)
  assert prompt.endswith(fmt.THINK_END + "The answer is") and not turn.thinking
  assert turn.message(" 7")["content"] == "The answer is 7"
  closed = chat_turn(texts, ChatRequest(messages=open_))
  assert texts.tokenizer.encode(fmt.EOS)[0] in closed.prompt[-2:] and closed.message(" 7")["content"] == " 7"
  think = lambda **kw: chat_turn(texts, ChatRequest(messages=USER, **kw)).thinking  # noqa: E731
  assert think(reasoning_effort="high") and not think(reasoning_effort="none")
  assert not think(reasoning_effort="high", chat_template_kwargs={"thinking": False})  # the kwargs say
  hidden = chat_turn(texts, ChatRequest(messages=USER, reasoning_effort="high", include_reasoning=False))
  assert hidden.thinking and "reasoning_content" not in hidden.message("7" + fmt.THINK_END + "8")
  fresh = chat_turn(texts, ChatRequest(messages=USER, reasoning_effort="high", include_reasoning=False))
  assert fresh.message("") == {"role": "assistant", "content": ""}
  with_bos = chat_turn(texts, ChatRequest(messages=USER, add_special_tokens=True)).prompt
  assert with_bos == chat_turn(texts, ChatRequest(messages=USER)).prompt  # the format writes BOS: not a second one
  with pytest.raises(Exception) as e:
    chat_turn(texts, ChatRequest(messages=USER, continue_final_message=True))
  assert getattr(e.value, "param", None) == "continue_final_message"
