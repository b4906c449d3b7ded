"""One OpenAI server over two processes (docs/multihost.md "Serving over several processes"): 2 processes x 4
CPU devices (jax.distributed on localhost, gloo) answer concurrent requests through the openai client
(greedy, seeded sampling, streaming, logprobs) exactly as 1 process x 8 devices does; processes started with
different configs end with one config error line, exit 2, before any compile; SIGKILL of the worker under
load ends every request with an error (a 503, or an error event on a stream) and both processes exit,
process 0 with 1. One fixture starts both servers at once; every wait is bounded; everything started is
killed at the end."""

import json
import socket
import threading
import time

import httpx
import pytest

from tests.support.multihost_serving import launch, workload

START_S = 400  # seconds a server may take to compile and answer /health 200 (a loaded 2-core host)
REQUESTS = ["greedy", "seeded", "stream", "logprobs"]  # few step variants: few compiles
SMALL = ["max_target_length=64", "max_prefill_length=32", "serve_page_size=8", "prefill_chunk_size=16",
         "serve_max_num_tokens=64"]  # these prompts are short: smaller pools and programs than SERVE's


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
  for p in procs:
    try:
      p.communicate(timeout=30)
    except Exception:  # noqa: BLE001 - already reaped, or pipes closed
      pass


def _ready(url: str, procs, deadline: float) -> None:
  while time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      outs = [p.communicate(timeout=30) for p in procs]
      pytest.fail(f"a server process ended before it was ready: {[p.returncode for p in procs]}\n"
                  + "\n".join(e[-3000:] for _, e in outs))
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(0.5)
  pytest.fail(f"{url} not ready within {START_S} s")


@pytest.fixture(scope="module")
def servers():
  """(url of 2 processes x 4 devices, its Popens, url of 1 process x 8 devices): started together."""
  two_port, one_port = _port(), _port()
  two = launch(two_port, processes=2, devices=4, coordinator_port=_port(), extra=SMALL, timeout_s=120)
  one = launch(one_port, processes=1, devices=8, coordinator_port=0, extra=SMALL)
  try:
    deadline = time.monotonic() + START_S
    _ready(f"http://127.0.0.1:{two_port}", two, deadline)
    _ready(f"http://127.0.0.1:{one_port}", one, deadline)
    yield f"http://127.0.0.1:{two_port}", two, f"http://127.0.0.1:{one_port}"
  finally:
    _kill(two + one)


def test_two_processes_answer_exactly_as_one_process_with_all_devices(servers):
  two_url, _, one_url = servers
  two = workload(two_url, REQUESTS, timeout=300)
  assert two == workload(one_url, REQUESTS, timeout=300)
  assert len(two["logprobs"]["logprobs"]) == 8 and two["greedy"]["text"] == two["logprobs"]["text"]


def test_processes_with_different_configs_fail_with_one_line_before_compiling():
  procs = launch(_port(), processes=2, devices=4, coordinator_port=_port(), timeout_s=60,
                 per_process={1: ["serve_max_waiting=7"]})
  try:
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    _kill(procs)
  for p, (_, err) in zip(procs, outs):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, err[-2000:])
    assert "different configs (1 key(s) differ: serve_max_waiting=256 on process 0, 7 on process 1)" in lines[0]
    assert "compiled" not in err and "Traceback" not in err


def test_sigkill_of_the_worker_under_load_errors_every_request_and_both_exit(servers):
  import concurrent.futures
  url, procs, _ = servers

  def plain(i):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "The sea is", "max_tokens": 50, "ignore_eos": True,
                                                  "temperature": 0.5, "seed": i}, timeout=120)
    return r.status_code, r.json()

  def streamed(i):
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"prompt": "Once", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
      if r.status_code != 200:  # it had not started when the worker died: a plain error
        return r.status_code, json.loads(r.read())
      for line in r.iter_lines():
        if line.startswith("data: "):
          events.append(line[6:])
          first.set()
    return r.status_code, events

  first = threading.Event()
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    futures = [pool.submit(plain if i % 2 else streamed, i) for i in range(4)]
    assert first.wait(120), "no token streamed"
    procs[1].kill()  # every request has 40+ tokens to go
    killed = time.monotonic()
    results = [f.result(timeout=60) for f in futures]
  for status, body in results:  # a 503, or a stream that had started: its error event, then [DONE]
    if status == 200:
      assert body[-1] == "[DONE]" and "lost one of its processes" in json.loads(body[-2])["error"]["message"], body[-3:]
    else:
      assert status == 503 and "lost one of its processes" in body["error"]["message"], body
  assert any(status == 200 for status, _ in results)  # at least the stream that had begun
  assert procs[0].wait(timeout=30) == 1
  assert time.monotonic() - killed < 30
