"""The server's hardening (issue 55), over the real app, uvicorn and engine thread with the scripted
engine (tests/server_harness.py: no model): the API key (server/gate.py: bearer on every route but
/health and /metrics, 401 in OpenAI's body, the key never echoed; the config key over the environment
variable; to_yaml and repr mask it), the body's size (413 before parsing, by Content-Length or by the
bytes of a chunked body), n / best_of bounds, and serve_request_timeout (the scheduler ends the request
and frees its pages; a plain request gets a 408, a streamed one the error as its last event)."""

import json
import os

import httpx
import pytest

from MaxText.config import pyconfig
from MaxText.inference.page_allocator import PageAllocator
from MaxText.inference.scheduler import SamplingParams, Scheduler
from MaxText.server import gate
from MaxText.server.protocol import ApiError, CompletionRequest
from tests.conftest import make_config
from tests.support.server_harness import scripted_server, wait_for

KEY = "sk-test-5b1e"
MAX_BYTES = 400


def _served(**keys):
  """(url, ScriptedEngine, Server) for the app under `keys` (config overrides)."""
  return scripted_server(make_config(**keys))


@pytest.fixture(scope="module")
def keyed():
  with _served(serve_api_key=KEY, serve_max_request_bytes=MAX_BYTES) as served:
    yield served


def _error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
  assert code is None or err["code"] == code, err
  return err


# ---------------------------------------------------------------- the API key


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/tokenizer_info", None),
    ("GET", "/docs", None)])
def test_every_route_but_health_and_metrics_needs_the_bearer_key(keyed, method, path, body):
  url, _, _ = keyed
  for headers in ({}, {"Authorization": "Bearer nope-123"}, {"Authorization": f"Basic {KEY}"},
                  {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY}):
    r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
    err = _error(r, 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text and "nope-123" not in r.text  # neither the key nor what was sent comes back


def test_the_right_key_passes_in_any_scheme_case_and_health_and_metrics_stay_open(keyed):
  url, _, _ = keyed
  assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
  r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"bearer {KEY}"},
                 json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == "102,103", r.text
  assert httpx.get(f"{url}/health").status_code == 200
  assert httpx.get(f"{url}/metrics").status_code == 200


def test_the_config_key_wins_over_the_environment_and_either_alone_is_used():
  env = {gate.API_KEY_ENV: "from-env"}
  assert gate.api_key(make_config(serve_api_key="from-config"), env) == "from-config"
  assert gate.api_key(make_config(), env) == "from-env"
  assert gate.api_key(make_config(), {}) is None
  assert "from-env" not in gate.describe(make_config(), env) and gate.API_KEY_ENV in gate.describe(make_config(), env)


def test_the_key_is_never_in_the_echoed_config_or_its_repr():
  cfg = make_config(serve_api_key=KEY)
  assert KEY not in pyconfig.to_yaml(cfg) and "serve_api_key: ''" in pyconfig.to_yaml(cfg)
  assert KEY not in repr(cfg) and KEY not in str(cfg.serve_api_key)


def test_without_a_key_every_route_is_open(monkeypatch):
  monkeypatch.delenv(gate.API_KEY_ENV, raising=False)
  with _served() as (url, _, _):
    assert httpx.get(f"{url}/v1/models").status_code == 200


# ---------------------------------------------------------------- the body's size


def test_a_body_past_serve_max_request_bytes_is_a_413_before_it_is_parsed(keyed):
  url, _, _ = keyed
  auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  big = b"{" + b" " * MAX_BYTES + b"not json"  # past the bound and malformed: the size answers, not the parser
  err = _error(httpx.post(f"{url}/v1/completions", content=big, headers=auth), 413, "request_too_large")
  assert f"{len(big)} bytes" in err["message"] and f"serve_max_request_bytes={MAX_BYTES}" in err["message"]

  def chunks():  # no Content-Length: chunked transfer, counted as it comes
    for _ in range(4):
      yield b" " * (MAX_BYTES // 2)

  err = _error(httpx.post(f"{url}/v1/completions", content=chunks(), headers=auth), 413, "request_too_large")
  assert f"more than {MAX_BYTES} bytes" in err["message"]
  # at the bound exactly: parsed (here a 400 naming the field: the body reached the route whole)
  body = json.dumps({"prompt": [1, 2], "max_tokens": 1, "n": 0}).encode()
  body += b" " * (MAX_BYTES - len(body))
  _error(httpx.post(f"{url}/v1/completions", content=body, headers=auth), 400, param="n")


# ---------------------------------------------------------------- n and best_of


@pytest.mark.parametrize("fields,param", [({"n": 0}, "n"), ({"n": -3}, "n"), ({"n": 2}, "n"), ({"n": 10 ** 12}, "n"),
                                          ({"best_of": 0}, "best_of"), ({"best_of": 2}, "best_of"),
                                          ({"best_of": 10 ** 12}, "best_of")])
def test_n_and_best_of_outside_their_bounds_are_a_400_naming_the_field(fields, param):
  with pytest.raises(ApiError) as e:
    CompletionRequest(prompt=[1], **fields).check()
  assert e.value.status == 400 and e.value.param == param, e.value.message
  CompletionRequest(prompt=[1], n=1, best_of=1).check()


# ---------------------------------------------------------------- serve_request_timeout


def test_the_scheduler_ends_requests_past_their_timeout_running_or_waiting_and_frees_their_pages():
  sched = Scheduler(PageAllocator(8, page_size=4), max_num_seqs=1, max_num_tokens=8, chunk=8, max_length=32,
                    eos_id=None, vocab_size=50)
  running = sched.add([5] * 6, SamplingParams(max_tokens=20, timeout=30.0))
  waiting = sched.add([6] * 3, SamplingParams(max_tokens=3, timeout=30.0))
  free = sched.add([7] * 3, SamplingParams(max_tokens=3))  # no limit
  rows = sched.schedule()
  sched.update(rows, [1] * len(rows))
  assert [r.request for r in rows] == [running] and sched.allocator.used_pages == 2
  running.arrival -= 31.0
  waiting.arrival -= 31.0
  free.arrival -= 1000.0
  rows = sched.schedule()
  assert running.finish_reason == waiting.finish_reason == "timeout" and free.finish_reason is None
  assert [r.request for r in rows] == [free] and sched.take_finished() == [running, waiting]
  sched.abort(free)
  assert sched.allocator.used_pages == 0


def test_a_request_past_serve_request_timeout_is_a_408_and_its_pages_are_freed():
  with _served(serve_request_timeout=0.3) as (url, eng, server):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 28}, timeout=10)
    err = _error(r, 408, "request_timeout")
    assert "serve_request_timeout=0.3" in err["message"]
    assert eng.requests[-1].finish_reason == "timeout" and len(eng.requests[-1].output) < 28
    wait_for(lambda: eng.scheduler.idle and eng.allocator.used_pages == 0, "its pages to be freed", timeout=10)
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 28, "stream": True},
                      timeout=10) as r:
      events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) > 2
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert all("choices" in json.loads(e) for e in events[:-2])  # the tokens made before it, streamed
    wait_for(lambda: eng.scheduler.idle and eng.allocator.used_pages == 0, "its pages to be freed", timeout=10)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'maxtext_requests_total{finish_reason="timeout"} 2.0' in metrics, metrics
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_the_environment_variable_alone_turns_the_key_on(monkeypatch):
  monkeypatch.setenv(gate.API_KEY_ENV, "env-key")
  with _served() as (url, _, _):
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer env-key"}).status_code == 200
  assert os.environ[gate.API_KEY_ENV] == "env-key"


def test_serve_keep_alive_reaches_uvicorn_and_must_be_positive():
  """An idle connection's lifetime is the key's (a balancer's idle timeout must stay below it); 0 is refused."""
  from MaxText.serve import uvicorn_server
  assert uvicorn_server(make_config(serve_keep_alive=75.0), app=None).config.timeout_keep_alive == 75.0
  assert uvicorn_server(make_config(), app=None).config.timeout_keep_alive == 5.0
  with pytest.raises(pyconfig.ConfigError, match="serve_keep_alive"):
    make_config(serve_keep_alive=0)
