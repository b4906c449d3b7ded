"""The OpenAI-compatible server (MaxText/serve.py, MaxText/server/) in this process on a free localhost
port, one tiny model saved to disk and loaded as a trained run is: the real `openai` client (plain,
streamed, chat), greedy outputs equal to decode.py's for the same prompts and weights, lm-evaluation-harness
scoring the served model as our teacher-forced model does (MaxText/server/lm_eval_client.py), OpenAI error
bodies naming the field for bad input (httpx), a disconnect mid-stream
freeing its pages, and 64 concurrent streaming clients that all finish with every page free after."""

import asyncio
import functools
import io
import json
import os
import re
import shutil
import time

import httpx
import numpy as np
import openai
import pytest

from MaxText import decode
from MaxText.checkpoint import model_state
from MaxText.data.tokenizer import load_tokenizer
from MaxText.runtime import sharding
from MaxText.server.in_process import serve_in_thread
from MaxText.server.lm_eval_client import Teacher, loopback_only, run_lm_eval
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import wait_for

DATA = os.path.join(REPO_ROOT, "tests", "data")
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEYS = dict(max_target_length=48, max_prefill_length=32, param_init_std=0.2, mtp_num_layers=0, serve_page_size=8,
            serve_max_num_seqs=4, serve_max_num_tokens=64, prefill_chunk_size=16, serve_max_waiting=64,
            tokenizer_type="hf")
PROMPTS = ["I love to", "The sea is"]


def _metrics(url) -> dict[str, float]:
  text = httpx.get(f"{url}/metrics", timeout=10).text
  return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


_wait_for = functools.partial(wait_for, timeout=20.0, poll=0.05)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
  """(folder, graphdef, params, buffers): a tokenizer folder with a chat template in its
  tokenizer_config.json, and the tiny model's parameters saved in it as a run's."""
  tmp = tmp_path_factory.mktemp("served")
  shutil.copy(os.path.join(DATA, "tokenizer.json"), tmp / "tokenizer.json")
  (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
  cfg = make_config(**KEYS, tokenizer_path=str(tmp / "tokenizer.json"))
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  model_state.save_parameters(str(tmp / "params"), params, buffers)
  return tmp, graphdef, params, buffers


@pytest.fixture(scope="module")
def served(weights):
  """(config, base url, Server): the server over `weights` on a pre-bound free port in a thread; stopped at
  the end."""
  from MaxText.serve import create_server
  tmp = weights[0]
  cfg = make_config(**KEYS, tokenizer_path=str(tmp / "tokenizer.json"), load_parameters_path=str(tmp / "params"))
  server, app = create_server(cfg, log=lambda line: None)
  with serve_in_thread(app) as (url, thread):
    _wait_for(lambda: _get_status(f"{url}/health") == 200, "/health 200", timeout=600)  # compiling: ~60 s alone, 5x that on a loaded host
    yield cfg, url, server
  assert not thread.is_alive() and server.engine.state == "stopped"


def _get_status(url) -> int:
  try:
    return httpx.get(url, timeout=5).status_code
  except httpx.TransportError:
    return 0


def _client(url):
  return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_greedy_completions_equal_decode_py_for_the_same_prompts_and_weights(served):
  cfg, url, _ = served
  out = io.StringIO()
  decode.run(cfg.model_copy(update={"prompt": "|".join(PROMPTS)}), out=out, err=io.StringIO())
  want = {int(i): [int(x) for x in v.split(",") if x] for i, v in re.findall(r"^row (\d+) ids: ?(.*)$",
                                                                               out.getvalue(), re.M)}
  tok = load_tokenizer(cfg)
  client = _client(url)
  model = client.models.list().data[0].id
  for i, prompt in enumerate(PROMPTS):
    ids = [tok.bos_id] + tok.encode(prompt)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=cfg.max_target_length - len(ids),
                                  temperature=0, extra_body={"return_token_ids": True})
    choice = r.choices[0].model_dump()
    assert choice["token_ids"] == want[i], i
    assert r.model_dump()["prompt_token_ids"] == ids
    assert choice["text"] == tok.decode(want[i])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want[i])
    assert choice["finish_reason"] == ("length" if len(ids) + len(want[i]) == cfg.max_target_length else "stop")
  # token ids and a list of prompts: one choice each, in order, the same tokens
  ids = [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
  r = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                extra_body={"return_token_ids": True})
  assert [c.model_dump()["token_ids"] for c in r.choices] == [want[0][:6], want[1][:6]]


def test_streaming_sends_each_token_as_it_is_made_then_usage_and_done(served):
  cfg, url, _ = served
  client = _client(url)
  plain = client.completions.create(model=cfg.model_name, prompt="I love to", max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
  chunks, times = [], []
  for chunk in client.completions.create(model=cfg.model_name, prompt="I love to", max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True, "return_token_ids": True}):
    chunks.append(chunk)
    times.append(time.perf_counter())
  tokens = [c for c in chunks if c.choices]
  assert len(tokens) == 21  # one chunk per token, then the finish_reason
  assert "".join(c.choices[0].text for c in tokens) == plain.choices[0].text
  assert sum((c.choices[0].model_dump()["token_ids"] for c in tokens), []) == plain.choices[0].model_dump()["token_ids"]
  assert tokens[-1].choices[0].finish_reason == "length"
  assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
  assert times[19] - times[0] > 0.005  # sent as made: 20 engine steps apart, not in one burst at the end
  # several prompts stream together: each chunk names its choice, each choice's text is its plain text
  both = client.completions.create(model=cfg.model_name, prompt=PROMPTS, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
  texts, reasons = ["", ""], [None, None]
  for chunk in client.completions.create(model=cfg.model_name, prompt=PROMPTS, max_tokens=8, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}):
    c = chunk.choices[0]
    texts[c.index] += c.text
    reasons[c.index] = c.finish_reason or reasons[c.index]
  assert texts == [c.text for c in both.choices] and reasons == ["length", "length"]
  # the raw stream ends with [DONE]
  with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "I love to", "max_tokens": 3, "stream": True},
                    timeout=30) as r:
    lines = [line for line in r.iter_lines() if line]
  assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
  assert len(lines) == 5  # 3 tokens, the finish_reason, [DONE]


def test_chat_renders_the_tokenizer_config_template_plain_and_streamed(served):
  cfg, url, _ = served
  tok = load_tokenizer(cfg)
  client = _client(url)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The sea"}]
  r = client.chat.completions.create(model=cfg.model_name, messages=messages, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})
  prompt = tok.encode("<s><|system|>Be brief.\n<|user|>The sea\n<|assistant|>")
  assert r.model_dump()["prompt_token_ids"] == prompt and prompt[0] == tok.bos_id
  same = client.completions.create(model=cfg.model_name, prompt=prompt, max_tokens=8, temperature=0)
  assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == same.choices[0].text
  streamed = list(client.chat.completions.create(model=cfg.model_name, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
  assert streamed[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
  assert streamed[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_cut_the_text_and_sampling_with_a_seed_repeats(served):
  cfg, url, _ = served
  client = _client(url)
  full = client.completions.create(model=cfg.model_name, prompt="The sea is", max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
  stop = full[len(full) // 2:len(full) // 2 + 2]
  assert len(stop) == 2 and stop.strip()
  for stream in (False, True):
    r = client.completions.create(model=cfg.model_name, prompt="The sea is", max_tokens=24, temperature=0,
                                  stop=[stop], stream=stream, extra_body={"ignore_eos": True})
    chunks = list(r) if stream else [r]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[:full.index(stop)], stream
    assert chunks[-1].choices[0].finish_reason == "stop"
  sampled = [client.completions.create(model=cfg.model_name, prompt="I love to", max_tokens=10, temperature=1.0,
                                       top_p=0.9, seed=s, extra_body={"ignore_eos": True, "top_k": 50}).choices[0].text
             for s in (5, 5, 6)]
  assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 46}, "max_tokens"),  # prompt + max_tokens past max_target_length=48
    ({"prompt": [1, 2, 9999]}, "prompt"),
    ({"prompt": list(range(3, 51))}, "prompt"),  # the prompt alone fills the context
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
])
def test_bad_input_is_an_openai_error_naming_the_field(served, body, param):
  _, url, _ = served
  r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
  assert r.status_code == (404 if param == "model" else 400), r.text
  err = r.json()["error"]
  assert err["param"] == param and err["message"] and err["type"] and "code" in err, err


def test_bad_chat_and_malformed_json_are_400s_and_the_server_survives(served):
  _, url, _ = served
  r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
  r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30,
                 headers={"content-type": "application/json"})
  assert r.status_code == 400 and "error" in r.json()
  assert _get_status(f"{url}/health") == 200
  assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_frees_its_pages(served):
  cfg, url, _ = served
  before = _metrics(url).get('maxtext_requests_total{finish_reason="abort"}', 0.0)
  with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
      "prompt": "I love to", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")  # the request runs
  # the connection is closed after one token, 39 before it would end
  _wait_for(lambda: _metrics(url).get('maxtext_requests_total{finish_reason="abort"}', 0.0) == before + 1,
            "the request to be aborted")
  m = _metrics(url)
  assert m["maxtext_requests_running"] == 0 and m["maxtext_pages_used"] == 0


def test_64_concurrent_streaming_clients_all_finish_and_every_page_is_free_after(served):
  cfg, url, _ = served
  tok = load_tokenizer(cfg)
  words = "the sea is calm and I love to eat fish by the water".split()
  jobs = [(" ".join(words[:1 + (7 * i) % len(words)]), 4 + (5 * i) % 13) for i in range(64)]  # mixed lengths

  async def one(client, prompt, n):
    got, reason = [], None
    stream = await client.completions.create(model=cfg.model_name, prompt=prompt, max_tokens=n, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
      got += chunk.choices[0].model_dump()["token_ids"]
      reason = chunk.choices[0].finish_reason or reason
    return got, reason

  async def crowd():
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return await asyncio.wait_for(asyncio.gather(*[one(client, p, n) for p, n in jobs]), timeout=60)

  t0 = time.perf_counter()
  results = asyncio.run(crowd())
  elapsed = time.perf_counter() - t0
  assert [len(got) for got, _ in results] == [n for _, n in jobs]
  assert all(reason == "length" for _, reason in results)
  assert all(t < tok.vocab_size for got, _ in results for t in got)
  # greedy output does not depend on what shares the batch: equal prompts give equal tokens
  by_prompt = {}
  for (prompt, n), (got, _) in zip(jobs, results):
    by_prompt.setdefault(prompt, []).append(got)
  for outs in by_prompt.values():
    longest = max(outs, key=len)
    assert all(o == longest[:len(o)] for o in outs)
  m = _metrics(url)
  assert m["maxtext_requests_running"] == 0 and m["maxtext_requests_waiting"] == 0
  assert m["maxtext_pages_used"] == 0 and m["maxtext_pages_total"] > 0 and m["maxtext_step_programs"] > 0
  assert m["maxtext_time_to_first_token_seconds_count"] >= 64 and m["maxtext_generation_tokens_total"] >= sum(
      n for _, n in jobs)
  print(f"\n64 streaming clients, {sum(n for _, n in jobs)} tokens in {elapsed:.1f} s")
  assert elapsed < 60


def test_lm_eval_scores_the_served_model_as_our_teacher_forced_model_does(served, weights):
  """lm-eval's local-completions (tokenizing through /tokenize) over the local tasks: per multiple-choice
  item, its loglikelihoods are the training model's teacher-forced ones (1e-4) and its accuracy ours;
  its generate_until outputs are the training model's greedy ones; it reaches nothing past 127.0.0.1."""
  cfg, url, server = served
  with loopback_only() as tried:
    samples = run_lm_eval(url, cfg.model_name)
  assert tried == []
  teacher = Teacher(*weights[1:], server.texts.tokenizer, cfg.max_target_length)
  mc, gen = samples["tiny_mc"], samples["tiny_gen"]
  assert len(mc) == 8 and len(gen) == 4
  for s in mc:
    ours = teacher.choices(s["doc"])
    np.testing.assert_allclose([r[0] for r in s["filtered_resps"]], ours, atol=1e-4, err_msg=f"item {s['doc_id']}")
    assert s["acc"] == float(int(np.argmax(ours)) == s["doc"]["answer"]), s["doc_id"]
  assert [s["filtered_resps"][0] for s in gen] == [teacher.greedy(s["doc"]["question"]) for s in gen]
