"""tool_choice "required" and named, served by the real engine (the tiny model, random weights: an adversarial
writer) in this process (MaxText/serve.py's create_server, MaxText/server/in_process.py): with docs/chat.md's
own tool (a free string city) and an integer 1-7, greedy and sampled, every forced call closes within
docs/chat.md's max_tokens=128 (finish_reason "tool_calls", never "length") and its arguments match the
tool's schema, streamed as whole. The grammar's own boundaries are tests/unit/test_tool_grammar.py's."""

import json
import os
import time

import httpx
import pytest

from MaxText.server.in_process import serve_in_thread
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import wait_for

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
KEYS = dict(max_target_length=1088, max_prefill_length=1024, param_init_std=0.2, mtp_num_layers=0, serve_page_size=64,
            serve_max_num_seqs=4, serve_max_num_tokens=256, prefill_chunk_size=256, serve_width_buckets=1,
            serve_context_buckets=1, tokenizer_type="hf", tokenizer_path=TOKENIZER)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # docs/chat.md's tool
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["n"]}}}
VALID = {"get_weather": lambda a: set(a) == {"city"} and isinstance(a["city"], str),
         "pick": lambda a: set(a) == {"n"} and type(a["n"]) is int and 1 <= a["n"] <= 7}


@pytest.fixture(scope="module")
def url():
  from MaxText.serve import create_server
  server, app = create_server(make_config(**KEYS), log=lambda line: None)
  with serve_in_thread(app) as (base, _):
    wait_for(lambda: server.engine.ready, "the engine to compile", timeout=600)
    yield base


@pytest.mark.parametrize("tool", [WEATHER, PICK], ids=["chat_md_city", "integer_1_7"])
def test_forced_calls_close_within_max_tokens_and_their_arguments_match_the_schema(url, tool):
  name = tool["function"]["name"]
  named = {"type": "function", "function": {"name": name}}
  for choice, parallel, temperature, seed in (("required", False, 0.0, 0), (named, True, 0.0, 0),
                                              ("required", False, 1.0, 1), (named, True, 1.0, 2)):
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [tool],
        "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 128, "temperature": temperature,
        "seed": seed})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, (choice, c)
    (call,) = c["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == name and VALID[name](args), (call, time.monotonic() - started)


def test_a_streamed_forced_call_is_the_same_call_as_the_whole_reply(url):
  import openai
  client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  kw = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=128,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0)
  whole = client.chat.completions.create(**kw).choices[0]
  calls, reasons = [], []
  for chunk in client.chat.completions.create(stream=True, **kw):
    calls += chunk.choices[0].delta.tool_calls or []
    reasons.append(chunk.choices[0].finish_reason)
  assert [c.function.arguments for c in calls] == [whole.message.tool_calls[0].function.arguments]
  assert reasons[-1] == whole.finish_reason == "tool_calls" and calls[0].index == 0


def test_a_tool_schema_the_grammar_cannot_hold_is_a_400_naming_its_place(url):
  bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "x": {"type": "string", "pattern": "("}}}}}
  r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
      "messages": [{"role": "user", "content": "Hi"}], "tools": [bad], "tool_choice": "required", "max_tokens": 8})
  err = r.json()["error"]
  assert r.status_code == 400 and err["param"] == "tools[0].function.parameters.properties.x.pattern", err
