"""`python -m MaxText.serve` as users run it (a subprocess on a free localhost port): /health is 503
while the engine compiles, then 200; without a tokenizer prompts are token ids and the text is the
ids joined by commas; SIGTERM lets the running stream finish, refuses new connections and exits 0;
a bad config is one error line naming the key, exit 2."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import REPO_ROOT


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _status(url) -> int:
  try:
    return httpx.get(url, timeout=2).status_code
  except httpx.TransportError:
    return 0


def test_health_then_sigterm_drains_the_running_stream_and_exits_0():
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
      [sys.executable, "-m", "MaxText.serve", "configs/base.yml", f"serve_port={port}", "max_target_length=64",
       "serve_max_num_seqs=1", "serve_page_size=8", "prefill_chunk_size=1", "serve_shutdown_timeout=30"],  # 1 program
      cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    seen, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
      code = _status(f"{url}/health")
      if not seen or seen[-1] != code:
        seen.append(code)
      if code == 200:
        break
      time.sleep(0.05)
    assert seen[-1] == 200 and 503 in seen, (seen, proc.poll())
    # no tokenizer: token ids in, ids joined by commas out
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 17, 42], "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True}, timeout=30).json()
    assert r["choices"][0]["text"] == ",".join(map(str, r["choices"][0]["token_ids"]))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a long stream is running when SIGTERM comes: it finishes whole, then the process exits 0
    lines, first = [], threading.Event()

    def stream():
      with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
          "prompt": [1, 5, 6], "max_tokens": 60, "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
          if line:
            lines.append(line)
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(30)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert _status(f"{url}/health") == 0  # no new connection is accepted while draining
    reader.join(60)
    assert proc.wait(60) == 0, proc.stderr.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert lines[-1] == "data: [DONE]"
  chunks = [json.loads(line[6:]) for line in lines[:-1]]
  assert len("".join(c["choices"][0]["text"] for c in chunks).split(",")) == 60  # every token came
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  assert "Traceback" not in proc.stderr.read()


def test_a_unix_socket_server_answers_and_exits_0_soon_after_sigterm(tmp_path):
  """serve_uds: where no TCP socket may be opened (the lent TPU host), the server listens on a unix socket;
  idle, it exits 0 within 10 s of SIGTERM."""
  path = str(tmp_path / "serve.sock")
  proc = subprocess.Popen(
      [sys.executable, "-m", "MaxText.serve", "configs/base.yml", f"serve_uds={path}", "max_target_length=64",
       "serve_max_num_seqs=1", "serve_page_size=8", "prefill_chunk_size=1"],
      cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  client = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=30)
  try:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        if client.get("/health").status_code == 200:
          break
      except httpx.TransportError:
        pass
      time.sleep(0.1)
    r = client.post("/v1/completions", json={"prompt": [1, 17, 42], "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
  finally:
    client.close()
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  err = proc.stderr.read()
  assert f"listening on unix:{path}" in err and "Traceback" not in err, err


def test_a_bad_config_is_one_error_line_naming_the_key():
  r = subprocess.run([sys.executable, "-m", "MaxText.serve", "configs/base.yml", "chat_template_path=/no/such.jinja"],
                     cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr
  assert "chat_template_path='/no/such.jinja'" in r.stderr and "Traceback" not in r.stderr
