"""A soak of our OpenAI server on loopback: mixed traffic for --minutes, then the checks a deployment needs.

    python -m benchmarks.soak --minutes 30          # the figures in docs/deployment.md
    python -m benchmarks.soak --minutes 2 --clients 4

The server: the tiny model at random init (key=value overrides), an API key from $MAXTEXT_API_KEY. Traffic
(seeded, --clients closed-loop clients): completions, chat with tools, logprobs, JSON schemas, streams dropped
after the first event, malformed bodies, and bursts past serve_max_waiting every --burst-every seconds.
Checks once idle (CHECKS): no 5xx, no page leaked, resident memory growth after warm-up within 0.10 (programs
compiled since excluded), every accepted request counted by /metrics. Prints a table, then one JSON line;
exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import sys
import tempfile
import time

if __package__ in (None, ""):  # python benchmarks/soak.py: import the repo's packages
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve_load import DATA, REPO, started  # noqa: E402

KEY = "soak-" + os.urandom(8).hex()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


class Tally:
  def __init__(self):
    self.status = collections.Counter()  # HTTP status (0: no response: a transport error or timeout)
    self.kinds = collections.Counter()
    self.accepted = 0  # responses with a 200 status line: requests the engine took
    self.ttft: list[float] = []
    self.errors = collections.Counter()  # "kind status: what" of every 4xx/5xx but the expected ones, and no-answers

  def add(self, kind: str, status: int, why: str = ""):
    expected = {"malformed": 400}.get(kind, 429)  # a burst fills the queue: any request may meet a 429 then
    if status != 200 and status != expected:
      self.errors[f"{kind} {status}: {why[:160]}"] += 1
    self.kinds[kind] += 1
    self.status[status] += 1
    self.accepted += status in (200, 408)  # 408: taken, then ended at serve_request_timeout

  def server_errors(self) -> int:
    """5xx answers plus requests without an answer (status 0: a broken connection or the 120 s timeout)."""
    return sum(v for s, v in self.status.items() if s >= 500 or s == 0)


def _metrics(text: str) -> dict:
  out: dict = {"finished": 0.0}
  for m in re.finditer(r'^maxtext_requests_total\{finish_reason="(\w+)"\} (\S+)$', text, re.M):
    out["finished"] += float(m.group(2))
    out[f"finished_{m.group(1)}"] = float(m.group(2))
  for name in ("pages_used", "pages_total", "pages_cached", "requests_running", "requests_waiting", "step_programs"):
    m = re.search(rf"^maxtext_{name} (\S+)$", text, re.M)
    out[name] = float(m.group(1)) if m else None
  return out


def _by_minute(samples: list) -> dict:
  """The last sample of each whole minute: {"rss_mib": [...], "step_programs": [...]} (minute 0 first)."""
  last: dict = {}
  for minute, rss, programs in samples:
    last[int(minute)] = (round(rss, 1), None if programs is None else int(programs))
  return {"rss_mib": [last[k][0] for k in sorted(last)], "step_programs": [last[k][1] for k in sorted(last)]}


def growth_without_compiles(samples: list, warm_index: int) -> float:
  """Net resident-memory growth from samples[warm_index] on, summed over consecutive samples a, b that saw the
  same number of compiled step programs as the sample after b (a compile's memory is not a leak: XLA's compile
  peaks while the program is not yet counted, and the allocator keeps that memory), over the warm sample's size.
  samples: (minute, rss MiB, step programs or None) in time order; a pair with a None count is skipped."""
  tail = samples[warm_index:]
  if not tail:
    return 0.0
  counts = [p for _, _, p in tail]
  grown = sum(tail[i + 1][1] - tail[i][1] for i in range(len(tail) - 1)
              if counts[i] is not None and counts[i] == counts[i + 1] == counts[min(i + 2, len(tail) - 1)])
  return grown / tail[0][1]


def _rss_mib(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def _request(rng: random.Random, words: list[str]) -> tuple[str, str, dict | bytes]:
  """(kind, path, body) of one request of the mix."""
  at = rng.randrange(len(words) - 12)
  text = " ".join(words[at:at + rng.randint(2, 10)])
  x = rng.random()
  if x < 0.05:
    return "malformed", "/v1/completions", b'{"prompt": "' + text.encode() + b'", "max_tokens": '  # cut short
  if x < 0.15:
    return "disconnect", "/v1/completions", {"prompt": text, "max_tokens": 40, "stream": True, "ignore_eos": True}
  msgs = [{"role": "user", "content": text}]
  kind = rng.choice(["plain", "stream", "chat_tools", "logprobs", "json"])
  body: dict = {"max_tokens": rng.randint(2, 16), "temperature": rng.choice([0.0, 1.0]), "seed": rng.randrange(1000)}
  if kind == "plain":
    return kind, "/v1/completions", {**body, "prompt": text}
  if kind == "stream":
    return kind, "/v1/completions", {**body, "prompt": text, "stream": True, "stream_options": {"include_usage": True}}
  if kind == "chat_tools":
    return kind, "/v1/chat/completions", {**body, "messages": msgs, "tools": TOOLS, "stream": rng.random() < 0.5}
  if kind == "logprobs":
    return kind, "/v1/completions", {**body, "prompt": text, "logprobs": 3, "echo": rng.random() < 0.3}
  return kind, "/v1/chat/completions", {**body, "messages": msgs, "max_tokens": 24,
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": SCHEMA}}}


async def _send(client, url: str, kind: str, path: str, body, tally: Tally) -> None:
  t0 = time.perf_counter()
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  try:
    if isinstance(body, dict) and body.get("stream"):
      async with client.stream("POST", url + path, content=content) as r:
        if r.status_code != 200:
          tally.add(kind, r.status_code, (await r.aread()).decode(errors="replace"))
          return
        first = True
        async for line in r.aiter_lines():
          if line.startswith("data: ") and first:
            first = False
            tally.ttft.append(time.perf_counter() - t0)
            if kind == "disconnect":
              break  # the client goes away mid-stream: the server must abort it and free its pages
      tally.add(kind, r.status_code)
    else:
      r = await client.post(url + path, content=content)
      tally.add(kind, r.status_code, r.text if r.status_code != 200 else "")
  except Exception as e:  # noqa: BLE001 - a hung or broken connection counts against the server
    tally.add(kind, 0, f"{type(e).__name__}: {e}")


async def drive(url: str, seconds: float, clients: int, burst_every: float, burst: int, seed: int,
                tally: Tally, on_tick, keep_alive: float) -> None:
  import httpx
  words = open(os.path.join(DATA, "corpus.txt"), encoding="utf-8").read().split()
  deadline = time.monotonic() + seconds
  headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  # an idle pooled connection is dropped before the server's keep-alive (serve_keep_alive) closes it: at equal
  # timeouts a request can go out on a connection the server is closing (a ReadError, no answer)
  limits = httpx.Limits(max_connections=clients + burst + 4, keepalive_expiry=keep_alive / 2)
  async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:
    async def loop(i):
      rng = random.Random(seed * 1000 + i)
      while time.monotonic() < deadline:
        await _send(client, url, *_request(rng, words), tally)

    async def bursts():
      rng = random.Random(seed)
      while time.monotonic() + burst_every < deadline:
        await asyncio.sleep(burst_every)
        await asyncio.gather(*[_send(client, url, "burst", "/v1/completions",
                                     {"prompt": " ".join(rng.sample(words, 4)), "max_tokens": 8}, tally)
                               for _ in range(burst)])

    async def ticks():
      while time.monotonic() < deadline:
        await asyncio.sleep(10)
        try:
          m = _metrics((await client.get(url + "/metrics")).text)
        except Exception:  # noqa: BLE001 - a missed sample; the requests' own checks count a dead server
          m = {}
        on_tick(m)

    await asyncio.gather(*[loop(i) for i in range(clients)], bursts(), ticks())


def soak_checks(result: dict, tally: Tally) -> dict[str, bool]:
  """What a passing soak must show, by name (result: main's JSON fields; status 0 counts as a 5xx there)."""
  return {"no 5xx or hung request": result["status_5xx"] == 0,
          "every page back in the pool": result["pages_leaked"] == 0 and result["pages_cached"] <= result["pages_total"],
          "resident memory within 10% of warm-up (compiles aside)": result["rss_growth"] <= 0.10,
          "/metrics counts every accepted request": result["metrics_finished"] == tally.accepted,
          "429s seen (bursts past serve_max_waiting)": tally.status[429] > 0,
          "400s for the malformed bodies": tally.status[400] >= tally.kinds["malformed"]}


def server_args(port: int, max_waiting: int, max_seqs: int, overrides) -> list[str]:
  """The server's config arguments (after `python -m MaxText.serve`): the soak's settings, then the user's
  key=value (the later wins)."""
  return [os.path.join(REPO, "configs", "base.yml"), "tokenizer_type=hf", f"tokenizer_path={os.path.join(DATA, 'tokenizer.json')}",
          "add_bos=false", "serve_host=127.0.0.1", f"serve_port={port}", f"serve_max_waiting={max_waiting}",
          f"serve_max_num_seqs={max_seqs}", "max_target_length=1024", "serve_request_timeout=60", *overrides]


def server_config(serve_args: list[str]):
  """The Config the server resolves from serve_args (pyconfig, the loader MaxText.serve uses: base.yml, the
  model's yml, key=value), on one device and a mesh of ones: the soak reads serving keys (serve_keep_alive),
  which no mesh changes, and imports no jax. A config mistake raises ConfigError before the server starts."""
  from MaxText.config import pyconfig
  from MaxText.config.types import MESH_AXIS_KEYS
  ones = {MESH_AXIS_KEYS[a]: 1 for a in pyconfig.merged_values(["soak", *serve_args])["mesh_axes"]}
  return pyconfig.initialize(["soak", *serve_args], num_devices=1, **ones)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--minutes", type=float, required=True, help="how long the load runs (the run ends by itself)")
  ap.add_argument("--clients", type=int, default=6, help="closed-loop clients")
  ap.add_argument("--burst-every", type=float, default=30.0, help="seconds between bursts past serve_max_waiting")
  ap.add_argument("overrides", nargs="*", help="key=value for the server's config")
  args = ap.parse_args(argv)
  import httpx
  max_waiting, max_seqs = 4, 4
  from MaxText.config.types import ConfigError
  try:
    keep_alive = server_config(server_args(0, max_waiting, max_seqs, args.overrides)).serve_keep_alive
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2

  def command(port):
    return [sys.executable, "-m", "MaxText.serve", *server_args(port, max_waiting, max_seqs, args.overrides)]

  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "MAXTEXT_API_KEY": KEY,
         "PYTHONPATH": REPO}
  log_path = os.path.join(tempfile.mkdtemp(prefix="soak_"), "server.log")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed soak still stops its server (the with's end)
  t_start = time.monotonic()
  with started(command, env, log_path) as (proc, url):
    print(f"server up in {time.monotonic() - t_start:.0f} s (log {log_path}); load for {args.minutes} min", flush=True)
    tally, samples = Tally(), []  # samples: (minute since the load began, rss MiB, compiled step programs) a tick
    seconds = args.minutes * 60

    def tick(m: dict):
      samples.append(((time.monotonic() - t0) / 60, _rss_mib(proc.pid), m.get("step_programs")))

    t0 = time.monotonic()
    asyncio.run(drive(url, seconds, args.clients, args.burst_every, 3 * (max_waiting + max_seqs), 0,
                      tally, tick, keep_alive))
    wall = time.monotonic() - t0
    auth = {"Authorization": f"Bearer {KEY}"}
    deadline, m = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # the engine idle and every accepted request counted
      m = _metrics(httpx.get(f"{url}/metrics", headers=auth).text)
      if m["requests_running"] == 0 and m["requests_waiting"] == 0 and m["finished"] >= tally.accepted:
        break
      time.sleep(0.5)
    end_rss = _rss_mib(proc.pid)
  # the first sample after the warm-up (a minute, or a tenth of the run if longer), else the first
  warm_index = next((i for i, s in enumerate(samples) if s[0] * 60 >= max(60.0, 0.1 * seconds)), 0)
  warm_rss, warm_programs = samples[warm_index][1:] if samples else (end_rss, None)
  end_programs = m.get("step_programs")
  ttft = sorted(tally.ttft)
  p = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3)) if ttft else (lambda q: None)
  result = {
      "requests": sum(tally.status.values()), "status_5xx": tally.server_errors(),
      "pages_leaked": int(m.get("pages_used") or 0), "rss_growth": round(growth_without_compiles(samples, warm_index), 4),
      "rss_growth_total": round(end_rss / warm_rss - 1, 4),
      "programs_after_warmup": None if None in (warm_programs, end_programs) else int(end_programs - warm_programs),
      "p99_ttft_s": p(0.99), "p50_ttft_s": p(0.5), "minutes": round(wall / 60, 2),
      "accepted": tally.accepted, "metrics_finished": int(m.get("finished", 0)),
      "status": {str(k): v for k, v in sorted(tally.status.items())}, "kinds": dict(tally.kinds),
      "rss_mib": {"warm": round(warm_rss, 1), "end": round(end_rss, 1),
                  "max": round(max([s[1] for s in samples] + [end_rss]), 1)},
      "pages_cached": int(m.get("pages_cached") or 0), "pages_total": int(m.get("pages_total") or 0),
      "finish_reasons": {k[len("finished_"):]: int(v) for k, v in m.items() if k.startswith("finished_")},
      "unexpected": dict(tally.errors.most_common(5)), "by_minute": _by_minute(samples),
  }
  checks = soak_checks(result, tally)
  print(f"\n{'requests':>10} {'5xx':>5} {'accepted':>9} {'counted':>8} {'leaked':>7} {'rss warm':>9} {'rss end':>8} "
        f"{'p50 ttft':>9} {'p99 ttft':>9}")
  print(f"{result['requests']:>10} {result['status_5xx']:>5} {tally.accepted:>9} {result['metrics_finished']:>8} "
        f"{result['pages_leaked']:>7} {warm_rss:>9.1f} {end_rss:>8.1f} {str(result['p50_ttft_s']):>9} "
        f"{str(result['p99_ttft_s']):>9}")
  print(f"status {result['status']}; kinds {result['kinds']}; finish reasons {result['finish_reasons']}")
  print(f"rss MiB by minute {result['by_minute']['rss_mib']}")
  print(f"step programs by minute {result['by_minute']['step_programs']}")
  for what, n in tally.errors.most_common(8):
    print(f"  {n:>6} x {what}")
  for what, ok in checks.items():
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
  result["checks_passed"] = all(checks.values())
  print(json.dumps(result), flush=True)
  return 0 if result["checks_passed"] else 1


if __name__ == "__main__":
  sys.exit(main())
