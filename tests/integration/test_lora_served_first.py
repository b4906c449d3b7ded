"""The first request through a served LoRA adapter, asked the moment /health is ready under serve_warmup=first (the
other step programs then compile while idle, between requests), answers through the adapter: the same text as the
adapter asked again later, not the base's. Repeated over a few server starts (one start of five once answered the
first `adder` request of docs/lora.md with the base's text; not reproduced by the engine alone)."""

import json
import os
import shutil

import httpx
import jax
import pytest

from MaxText.checkpoint import model_state
from MaxText.runtime import sharding
from MaxText.server.in_process import serve_in_thread
from tests.conftest import REPO_ROOT, make_config
from tests.support.lora import write_adapter_run
from tests.support.server_harness import wait_for

STARTS = 3
KEYS = dict(max_target_length=48, param_init_std=0.2, mtp_num_layers=0, serve_page_size=8, serve_max_num_seqs=2,
            serve_max_num_tokens=32, prefill_chunk_size=16, tokenizer_type="hf", serve_warmup="first")
ASK = {"messages": [{"role": "user", "content": "63+15=?"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("served_first")
  shutil.copy(os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json"), tmp / "tokenizer.json")
  cfg = make_config(**KEYS, tokenizer_path=str(tmp / "tokenizer.json"))
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh):
    _, params, buffers, _ = model_state.create(cfg, mesh)
  model_state.save_parameters(str(tmp / "base"), params, buffers)
  write_adapter_run(str(tmp), "adder", 0, **KEYS, lora_rank=4, lora_alpha=8.0)
  return tmp


def _start_and_ask(tmp) -> dict:
  from MaxText.serve import create_server
  cfg = make_config(**KEYS, tokenizer_path=str(tmp / "tokenizer.json"), load_parameters_path=str(tmp / "base"),
                    serve_lora_adapters=[f"adder={tmp / 'adder'}"])
  server, app = create_server(cfg, log=lambda line: None)
  with serve_in_thread(app) as (url, _), httpx.Client(base_url=url, timeout=300) as client:
    wait_for(lambda: server.engine.ready, "the engine to compile", timeout=600)
    ask = lambda model: client.post("/v1/chat/completions", json={**ASK, **model}).json()["choices"][0]["message"]  # noqa: E731
    first = ask({"model": "adder"})["content"]  # while the other programs compile
    return {"first": first, "base": ask({})["content"], "again": ask({"model": "adder"})["content"]}


def test_the_first_request_through_an_adapter_answers_through_it_at_every_start(folders):
  got = [_start_and_ask(folders) for _ in range(STARTS)]
  for start in got:
    assert start["first"] == start["again"] != start["base"], json.dumps(got)
  assert len({(s["first"], s["base"]) for s in got}) == 1, json.dumps(got)
