"""The two-process server's proof (test_multiprocess_serving.py, docs/multihost.md): the server's command
on N processes, and a workload of concurrent requests through the openai client whose answers a
one-process server must equal exactly."""

import concurrent.futures
import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

# tiny: 2 layers, 8 sequences (a multiple of the 8 page shards), one prefill width and one context: few programs
SERVE = ["configs/base.yml", "tokenizer_type=hf", "tokenizer_path=tests/data/tokenizer.json", "num_decoder_layers=2",
         "mtp_num_layers=0", "max_target_length=1024", "max_prefill_length=960", "serve_page_size=32", "serve_max_num_seqs=8",
         "serve_width_buckets=1", "serve_context_buckets=1", "prefill_chunk_size=64", "serve_max_num_tokens=128",
         "serve_shutdown_timeout=20"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def launch(port: int, *, processes: int, devices: int, coordinator_port: int, extra=(), timeout_s: int = 60,
           per_process=None):
  """`python -m MaxText.serve SERVE` on `processes` processes of `devices` CPU devices each -> the Popens
  (stdout and stderr piped); per_process[i]: process i's extra keys. No persistent compilation cache with
  several processes (test_multiprocess.py)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO_ROOT,
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
         "JAX_ENABLE_COMPILATION_CACHE": "false"}
  procs = []
  for i in range(processes):
    dist = [] if processes == 1 else [f"distributed_coordinator_address=localhost:{coordinator_port}",
                                      f"distributed_num_processes={processes}", f"distributed_process_id={i}",
                                      f"distributed_initialization_timeout={timeout_s}"]
    procs.append(subprocess.Popen([sys.executable, "-m", "MaxText.serve", *SERVE, f"serve_port={port}", *dist,
                                   *extra, *(per_process or {}).get(i, [])], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  return procs


def _requests(client) -> dict:
  """name -> a function of no argument making one request, returning what must be equal (JSON-able)."""
  def completion(**kw):
    r = client.completions.create(model="deepseek3.2-tiny", max_tokens=8, **kw)
    c = r.choices[0]
    return {"text": c.text, "finish": c.finish_reason,
            "logprobs": None if c.logprobs is None else [round(x, 4) for x in c.logprobs.token_logprobs]}

  def streamed(**kw):
    return "".join(e.choices[0].text for e in client.completions.create(model="deepseek3.2-tiny", max_tokens=8,
                                                                        stream=True, **kw) if e.choices)

  def chat(**kw):
    r = client.chat.completions.create(model="deepseek3.2-tiny", max_tokens=12, **kw)
    m = r.choices[0].message
    return {"content": m.content, "tools": [t.function.arguments for t in m.tool_calls or []],
            "finish": r.choices[0].finish_reason}

  return {
      "greedy": lambda: completion(prompt="The sea is", temperature=0, extra_body={"ignore_eos": True}),
      "seeded": lambda: completion(prompt="I love to", temperature=1.0, seed=7, top_p=0.9,
                                   extra_body={"ignore_eos": True}),
      "stream": lambda: streamed(prompt="Once upon a time", temperature=0.8, seed=3, extra_body={"ignore_eos": True}),
      "logprobs": lambda: completion(prompt="The sea is", temperature=0, logprobs=2, extra_body={"ignore_eos": True}),
      "schema": lambda: chat(messages=[{"role": "user", "content": "Which city?"}], temperature=0,
                             response_format={"type": "json_schema",
                                              "json_schema": {"name": "city", "schema": SCHEMA}}),
      "tools": lambda: chat(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, temperature=0.7,
                            seed=11),
  }


def workload(url: str, names=None, timeout: float = 400) -> dict:
  """Every request of _requests (or those named) at once (they share the engine's steps) -> name -> result."""
  import openai
  client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
  calls = {k: v for k, v in _requests(client).items() if names is None or k in names}
  with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
    futures = {name: pool.submit(fn) for name, fn in calls.items()}
    return {name: f.result() for name, f in futures.items()}


if __name__ == "__main__":  # python -m tests.support.multihost_serving URL [name,...]: the answers as JSON
  print(json.dumps(workload(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else None), indent=1))
