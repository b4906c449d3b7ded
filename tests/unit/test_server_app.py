"""The routes' abort sites (MaxText/server/app.py), each on its own, over the real app, uvicorn and
engine thread with a scripted engine (tests/support/server_harness.py: no model): a plain request
whose client disconnects mid-generation (the collect path), a streamed one (the event stream), and
a request of several prompts one of which the engine refuses (the accepted ones), and a request cut
by a stop string (the text's own stop) are all aborted in the engine, their pages freed; and a 429
is OpenAI's body."""

import asyncio
import contextlib
import functools
import json
import os
import socket
import threading

import httpx
import pytest

from MaxText.data.tokenizer import load_tokenizer
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.protocol import Texts
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import ScriptedEngine, wait_for

DATA = os.path.join(REPO_ROOT, "tests", "data")
MAX_TOKENS = 28  # 28 steps of 0.08 s: a request runs over two seconds unless aborted


_wait_for = functools.partial(wait_for, timeout=10.0, poll=0.01)


@pytest.fixture(scope="module")
def served():
  """(base url, ScriptedEngine): the app on a pre-bound free port in a thread; stopped at the end."""
  import uvicorn
  eng = ScriptedEngine(step_s=0.08, token_base=300)  # from position 2: 'ver', ' e', 'ay', 'it', 'me', ...
  engine = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
  tokenizer = load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=os.path.join(DATA, "tokenizer.json")))
  texts = Texts(tokenizer, add_bos=False, vocab_size=512, chat_template=None, chat_template_source="none",
                special_tokens={})
  app = build_app(Server(make_config(), texts, engine, "tiny"))  # max_target_length 64 > the engine's 32
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  _wait_for(lambda: engine.ready and uv.started, "the server to start")
  try:
    yield url, eng
  finally:
    uv.should_exit = True
    thread.join(10)
    sock.close()


def _aborted_mid_generation(eng, request):
  _wait_for(lambda: request.finish_reason is not None, "the request to end")
  assert request.finish_reason == "abort" and 0 < len(request.output) < MAX_TOKENS, request.output
  _wait_for(lambda: eng.scheduler.idle and eng.allocator.used_pages == 0, "its pages to be freed")


def _running(eng, n_before):
  _wait_for(lambda: len(eng.requests) > n_before and eng.requests[-1].output, "the request to generate")
  return eng.requests[-1]


def test_a_plain_request_whose_client_disconnects_mid_generation_is_aborted(served):
  url, eng = served
  host, port = url.removeprefix("http://").split(":")
  body = json.dumps({"prompt": [1, 2], "max_tokens": MAX_TOKENS}).encode()
  n = len(eng.requests)
  with socket.create_connection((host, int(port))) as s:
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    request = _running(eng, n)
  _aborted_mid_generation(eng, request)  # the connection closed after a token or so


def test_a_streamed_request_whose_client_disconnects_mid_generation_is_aborted(served):
  url, eng = served
  n = len(eng.requests)
  with httpx.stream("POST", f"{url}/v1/completions", timeout=10, json={
      "prompt": [1, 2], "max_tokens": MAX_TOKENS, "stream": True}) as r:
    assert next(r.iter_lines()).startswith("data: ")
    request = _running(eng, n)
  _aborted_mid_generation(eng, request)


def test_the_accepted_prompts_of_a_request_the_engine_refuses_in_part_are_aborted(served):
  url, eng = served
  n = len(eng.requests)
  # the second prompt passes the server's check (max_target_length 64) but not the engine's (32)
  r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [[1, 2], [1] * 20], "max_tokens": 20})
  assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
  (first,) = eng.requests[n:]
  _wait_for(lambda: first.finish_reason is not None, "the accepted prompt to end")
  assert first.finish_reason == "abort" and len(first.output) < 20
  _wait_for(lambda: eng.scheduler.idle and eng.allocator.used_pages == 0, "its pages to be freed")


def test_a_stop_string_in_the_text_ends_the_request_in_the_engine_at_once(served):
  url, eng = served
  n = len(eng.requests)
  r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [1, 2], "max_tokens": MAX_TOKENS,
                                                              "stop": ["ayit"]})  # two tokens: no stop id
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ver e", r.text
  assert r.json()["choices"][0]["finish_reason"] == "stop"
  (request,) = eng.requests[n:]
  _wait_for(lambda: request.finish_reason is not None, "the request to end")
  assert request.finish_reason == "abort" and len(request.output) < MAX_TOKENS, request.output
  _wait_for(lambda: eng.scheduler.idle and eng.allocator.used_pages == 0, "its pages to be freed")


def test_past_serve_max_waiting_is_a_429_in_openais_body(served):
  url, eng = served
  got: list = []  # responses as they come

  async def burst():  # 2 sequence slots + 4 waiting accepted, the 7th refused
    async with httpx.AsyncClient(timeout=10) as c:
      async def one():
        got.append(await c.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}))
      await asyncio.gather(*[one() for _ in range(7)])

  eng.paused = True
  task = threading.Thread(target=lambda: asyncio.run(burst()))
  try:
    task.start()
    _wait_for(lambda: len(got) == 1, "the refusal while 6 requests wait")
  finally:
    eng.paused = False
  task.join(10)
  assert sorted(r.status_code for r in got) == [200] * 6 + [429]
  err = got[0].json()["error"]
  assert err["type"] == "rate_limit_error" and err["code"] == "too_many_waiting" and "serve_max_waiting" in err["message"]


def test_the_event_stream_aborts_its_requests_when_the_client_goes_away_before_they_end():
  """_EventStream's own abort, alone: the events generator is still referenced (not finalized), so
  only the response's end can abort the request."""
  from MaxText.server.app import _EventStream
  aborted = []
  server = type("S", (), {"engine": type("E", (), {"abort": staticmethod(aborted.append)})()})()
  stream = object()

  async def events():
    yield "data: {}\n\n"
    await asyncio.sleep(10)  # the request still runs

  async def receive():
    await asyncio.sleep(0.05)
    return {"type": "http.disconnect"}

  async def send(message):
    pass

  async def run():
    gen = events()
    scope = {"type": "http", "asgi": {"spec_version": "2.0"}}
    await asyncio.wait_for(_EventStream(server, [stream], gen)(scope, receive, send), 5)
    return gen

  gen = asyncio.run(run())
  assert aborted == [stream] and gen is not None


def test_fields_we_do_not_implement_are_a_400_naming_them_and_openais_client_fields_are_ignored(served):
  url, _ = served
  for field, value in (("suffix", "x"), ("reasoning_effort", "high"), ("frequency_penaltyy", 1)):
    r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [1, 2], "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"] and "docs/sampling.md" in r.json()["error"]["message"]
  r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [1, 2], "max_tokens": 1, "best_of": 2})
  assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text  # a field, bounded to 1
  for field, value, param in (("logit_bias", {"x": 1}, "logit_bias"), ("presence_penalty", 2.5, "presence_penalty"),
                              ("min_p", 1.5, "min_p")):
    r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [1, 2], "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
  r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [1, 2], "max_tokens": 1, "user": "u1",
                                                              "metadata": {"k": "v"}, "store": False})
  assert r.status_code == 200, r.text


def test_include_stop_str_in_output_keeps_the_stop_and_min_tokens_holds_stop_strings_back(served):
  url, _ = served
  body = {"prompt": [1, 2], "max_tokens": 6, "stop": ["ayit"]}
  kept = httpx.post(f"{url}/v1/completions", timeout=10, json={**body, "include_stop_str_in_output": True}).json()
  assert kept["choices"][0]["text"] == "ver eayit" and kept["choices"][0]["finish_reason"] == "stop"
  late = httpx.post(f"{url}/v1/completions", timeout=10, json={**body, "min_tokens": 4}).json()
  assert late["choices"][0]["text"].startswith("ver eayit") and late["choices"][0]["finish_reason"] == "length"


def test_a_body_that_is_not_json_and_an_unknown_route_answer_openais_error_body(served):
  url, _ = served
  r = httpx.post(f"{url}/v1/completions", timeout=10, content=b'{"prompt": [1, 2],', headers={
      "Content-Type": "application/json"})
  err = r.json()["error"]
  assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] is None
  assert "not valid JSON" in err["message"], err
  r = httpx.post(f"{url}/v1/tokenize", timeout=10, json={"prompt": "hi"})
  err = r.json()["error"]
  assert r.status_code == 404 and err["code"] == "not_found" and "/v1/tokenize" in err["message"]
  assert "POST /tokenize" in err["message"]  # the routes it does serve, every one of them:
  for route in ("GET /docs", "GET /openapi.json"):
    assert route in err["message"] and httpx.get(url + route.split()[1], timeout=10).status_code == 200, route
  err = httpx.get(f"{url}/v1/completions", timeout=10).json()["error"]
  assert err["code"] == "method_not_allowed" and "GET /openapi.json" in err["message"]
