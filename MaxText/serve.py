r"""An OpenAI-compatible server: python -m MaxText.serve configs/base.yml [key=value ...]

    python -m MaxText.serve outputs/mine/config.yml load_parameters_path=outputs/mine/checkpoints \
        tokenizer_type=hf tokenizer_path=tests/data/tokenizer.json serve_port=8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "I love to", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true for server-sent
events), GET /v1/models (the base and each of serve_lora_adapters), GET /health (503 while the engine compiles, 200 when ready), GET /metrics
(Prometheus). The engine is the continuous-batching one (MaxText/inference/serving.py, the serve_*
keys) in its own thread; the HTTP side is FastAPI + uvicorn (MaxText/server/).
load_parameters_path: as for decode.py (a converter output, a run's checkpoints folder, one step);
without it the parameters are random (said at start): a smoke test. Without tokenizer_path prompts
are token ids and the text of a choice is its ids joined by commas. Chat renders the chat template
(chat_template_path, or chat_template in the tokenizer_config.json next to tokenizer_path), or, without
one (DeepSeek-V3.2 ships none) or with chat_encoding=deepseek_v32, DeepSeek-V3.2's own format with
thinking and tool calls (MaxText/server/chat.py).
serve_host / serve_port (or serve_uds, a unix socket): where it listens; serve_warmup: what compiles before /health is 200; serve_max_waiting: waiting requests before a 429;
serve_api_key (or $MAXTEXT_API_KEY): the bearer key every route but /health and /metrics needs;
serve_max_request_bytes: the largest body (413); serve_request_timeout: seconds a request may run (408);
serve_lora_adapters=[name=path,...]: LoRA adapters served beside the base (vLLM's --lora-modules), each a LoRA run's
folder or checkpoint step; a request's "model" picks one (docs/lora.md, Serving adapters).
SIGTERM (or Ctrl-C): stop accepting, let running requests finish for up to serve_shutdown_timeout
seconds, exit 0. Bad config (an unknown key, a missing tokenizer) is one `error:` line, exit 2; a
missing checkpoint exit 1.

Several processes (the distributed_* keys, or a detected cluster; docs/multihost.md): the same command on
every process. Process 0 listens and runs the HTTP side and the scheduler; the others only replay its
engine's device calls (inference/step_channel.py) and listen on no port. Processes started with
different configs fail with one config error line before anything compiles. A process lost (killed,
crashed) ends every open request with a 503 error (an error event on a stream) and every process exits
non-zero within LOST_GRACE_S; SIGTERM on process 0 drains, then stops the others (exit 0).
"""

from __future__ import annotations

import sys

if not __package__ and __name__ == "__main__":  # run as `python MaxText/serve.py`: import the package
  import _script_path  # noqa: F401

import contextlib
import os
import signal
import threading

from MaxText.config.types import Config
from MaxText.runtime import cli, distributed

LOST_GRACE_S = 2.0  # process 0, a process lost: seconds its clients get to read their errors before it exits 1


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _engine_factory(config: Config, tokenizer, grammars, log, channel=None):
  """-> a context manager yielding the ServingEngine (parameters loaded now, on every process alike;
  errors exit as the CLI says). channel: process 0's step_channel (its engine announces each device call;
  "stop" when the engine ends without a lost process), or None."""
  import jax

  from MaxText.checkpoint import lora_adapters, model_state
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding

  eos_id = tokenizer.eos_id if tokenizer is not None else config.eos_id
  vocab = tokenizer.vocab_size if tokenizer is not None and tokenizer.vocab_size < config.vocab_size else None
  mesh = sharding.create_mesh(config)
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    # with serve_lora_adapters: the base + every adapter slot-stacked, under a config that adapts their linears
    engine_config, graphdef, params, buffers, source = lora_adapters.load_or_create(config, mesh, report=log)
  log(f"serve: model {config.model_name} ({model_state.count_params(params):,} parameters), {source}")

  @contextlib.contextmanager
  def make_engine():
    with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
      engine = ServingEngine(engine_config, graphdef, params, buffers, sample_vocab=vocab, eos_id=eos_id,
                             log=log, grammars=grammars)
      if channel is not None:
        engine.channel = channel
      try:
        yield engine
      finally:
        if channel is not None:
          channel.close()  # the followers return (not after a lost process: they exit on process 0's end)

  return make_engine


def create_server(config: Config, log=_log, channel=None):
  """-> (Server, FastAPI app): tokenizer, chat template and parameters loaded here (errors exit as
  the CLI says); the engine is built and compiled in its thread when the app starts. channel: several
  processes' step_channel (process 0's): a lost process fails every request and exits 1."""
  from MaxText.data.chat_template import chat_format
  from MaxText.data.tokenizer import load_tokenizer
  from MaxText.inference.grammar import Grammars
  from MaxText.server.app import Server, build_app
  from MaxText.server.engine_thread import EngineThread
  from MaxText.server.protocol import Texts

  tokenizer = load_tokenizer(config) if config.tokenizer_path else None
  fmt = chat_format(config, has_tokenizer=tokenizer is not None)  # the format SFT and RL render in too
  texts = Texts(tokenizer, add_bos=config.add_bos, vocab_size=config.vocab_size, chat_template=fmt.template,
                chat_template_source=fmt.source, special_tokens=fmt.special, chat_encoding=fmt.encoding,
                thinking=config.chat_thinking)
  grammars = Grammars.for_tokenizer(tokenizer, config.vocab_size)  # structured outputs; None without a tokenizer.json
  make_engine = _engine_factory(config, tokenizer, grammars, log, channel)
  log(f"serve: tokenizer {tokenizer.path if tokenizer else 'none (prompts are token ids)'}; chat template "
      f"{'yes' if fmt.template else 'none'}; chat format {fmt.encoding}")
  lost = None if channel is None else (lambda why: _lost(engine, why))
  engine = EngineThread(make_engine, max_waiting=config.serve_max_waiting, log=log, on_step_failure=lost,
                        warmup=config.serve_warmup)
  if channel is not None:
    channel.on_lost = lost
  server = Server(config, texts, engine, config.model_name, grammars=grammars)
  return server, build_app(server)


def _lost(engine, why: str) -> None:
  """Process 0, a process lost: every open request ends with a 503, then this process exits 1 (the others
  see it end and exit 1 too)."""
  from MaxText.server.protocol import ApiError
  _log(f"error: serve: {why}; every open request ends with an error; exiting in {LOST_GRACE_S:g} s")
  engine.fail(ApiError(503, f"the server lost one of its processes ({why}): it is shutting down", None,
                       "engine_failed"))
  threading.Timer(LOST_GRACE_S, lambda: os._exit(1)).start()


def follow(config: Config, channel) -> None:
  """A process other than 0: the engine only (no port), replaying process 0's device calls until it stops."""
  from MaxText.data.tokenizer import load_tokenizer
  from MaxText.inference import step_channel
  from MaxText.runtime.distributed import Silent

  tokenizer = load_tokenizer(config) if config.tokenizer_path else None  # its eos id and vocabulary size
  with _engine_factory(config, tokenizer, None, Silent().log)() as engine:
    made = step_channel.follow(engine, channel)
  _log(f"serve: process {channel.process} replayed {made} engine calls; stopped by process 0")


def uvicorn_server(config: Config, app):
  import uvicorn
  where = dict(uds=config.serve_uds) if config.serve_uds else dict(host=config.serve_host, port=config.serve_port)
  return uvicorn.Server(uvicorn.Config(app, **where, log_level="warning",
                                       access_log=False, timeout_graceful_shutdown=config.serve_shutdown_timeout,
                                       timeout_keep_alive=config.serve_keep_alive))


def serve(config: Config) -> None:
  from MaxText.inference import step_channel
  timeout = config.distributed_initialization_timeout
  distributed.check_same_config(config.model_dump(), timeout)  # before anything compiles
  channel = step_channel.open_channel(timeout)
  if not channel.main:
    follow(config, channel)
    return
  _, app = create_server(config, channel=channel if channel.multi else None)
  server = uvicorn_server(config, app)
  # uvicorn drains on SIGTERM, then raises the signal again: this handler makes that a clean exit 0.
  signal.signal(signal.SIGTERM, lambda *_: _log("serve: drained; exiting"))
  from MaxText.server.gate import describe
  where = f"unix:{config.serve_uds}" if config.serve_uds else f"http://{config.serve_host}:{config.serve_port}"
  _log(f"serve: listening on {where} (GET /health is 200 once compiled); "
       f"{describe(config)}")
  server.run()


def main(argv) -> None:
  cli.entry_point(argv, __doc__, serve)


if __name__ == "__main__":
  distributed.run_main(main, sys.argv)
