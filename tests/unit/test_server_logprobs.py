"""The server's logprobs, echo and /tokenize, /detokenize (MaxText/server/logprobs.py, app.py) over the
real app, uvicorn and engine thread with a scripted engine that records a known Logprob at every
position it computes (tests/integration/test_logprobs.py holds the engine's values to the model's):
OpenAI's completions shape with echo as lm-evaluation-harness reads it, max_tokens 0 scoring the prompt,
vLLM's prompt_logprobs, the chat shape plain and streamed, a 400 naming the field past serve_max_logprobs."""

import contextlib
import json
import os

import httpx
import pytest

from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.logprobs import Logprob
from MaxText.server.app import Server, build_app
from MaxText.server.engine_thread import EngineThread
from MaxText.server.in_process import serve_in_thread
from MaxText.server.protocol import Texts
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import ScriptedEngine

PROMPT = [5, 40, 41, 42, 43]


def _lp(pos: int, n: int = 2) -> Logprob:
  """What the scripted engine records at position pos: a known value, rank and the top n (<= 2)."""
  return Logprob(-pos / 10, 2, [(7, -0.01), (8, -pos / 10)][:n])


class LogprobEngine(ScriptedEngine):
  def next_tokens(self, rows):
    for row in rows:
      r = row.request
      for j in range(row.count):
        pos = row.start + j + 1
        asked = r.params.prompt_logprobs if pos < len(r.prompt) else r.params.logprobs
        if asked is not None and pos <= len(r.tokens):
          r.logprobs[pos] = _lp(pos, asked)
    return super().next_tokens(rows)


@pytest.fixture(scope="module")
def url():
  eng = LogprobEngine(token_base=300)
  engine = EngineThread(lambda: contextlib.nullcontext(eng), max_waiting=4, log=lambda line: None)
  tokenizer = load_tokenizer(make_config(tokenizer_type="hf",
                                         tokenizer_path=os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")))
  texts = Texts(tokenizer, add_bos=False, vocab_size=512, chat_template="{{ messages[0]['content'] }}",
                chat_template_source="test", special_tokens={"bos_token": "", "eos_token": "</s>"})
  with serve_in_thread(build_app(Server(make_config(), texts, engine, "tiny"))) as (base, _):
    with httpx.Client(base_url=base, timeout=30) as c:
      for _ in range(500):
        if c.get("/health").status_code == 200:
          break
      yield base, tokenizer


def _post(url, path, body):
  return httpx.post(url[0] + path, json=body, timeout=30)


def test_echo_with_logprobs_is_what_lm_eval_local_completions_reads(url):
  """lm-eval sends ids, max_tokens 1, logprobs 1, echo, temperature 0; reads token_logprobs[ctxlen:-1]."""
  r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True,
                                     "temperature": 0}).json()
  (c,) = r["choices"]
  lp, dec = c["logprobs"], url[1].decode
  assert c["text"] == dec(PROMPT) + dec([300 + len(PROMPT)])  # the prompt, then the token made
  assert lp["token_logprobs"] == [None] + [_lp(p).logprob for p in range(1, len(PROMPT) + 1)]
  assert lp["tokens"] == [dec([t]) for t in PROMPT + [300 + len(PROMPT)]]
  assert lp["top_logprobs"][0] is None
  assert lp["top_logprobs"][2] == {dec([7]): -0.01, dec([41]): -0.2}  # top 1, and the token itself
  assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(PROMPT) + 1)]


def test_max_tokens_0_with_echo_scores_the_prompt_only_and_vllm_prompt_logprobs(url):
  r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "logprobs": 0, "echo": True,
                                     "prompt_logprobs": 1}).json()
  (c,) = r["choices"]
  assert c["text"] == url[1].decode(PROMPT) and r["usage"]["completion_tokens"] == 0
  assert c["logprobs"]["token_logprobs"] == [None] + [_lp(p).logprob for p in range(1, len(PROMPT))]
  assert c["prompt_logprobs"][0] is None
  assert c["prompt_logprobs"][1] == {"7": {"logprob": -0.01, "rank": 1, "decoded_token": url[1].decode([7])},
                                     "40": {"logprob": -0.1, "rank": 2, "decoded_token": url[1].decode([40])}}
  stopped = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "logprobs": 0, "echo": True,
                                           "prompt_logprobs": 1, "stop_token_ids": [300 + len(PROMPT)]}).json()  # no token made
  assert stopped["choices"][0]["logprobs"] == c["logprobs"]  # the prompt's came with the end instead
  bad = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_logprobs_past_serve_max_logprobs_are_a_400_naming_the_field(url):
  for path, body, field in [("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
    r = _post(url, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_chat_logprobs_plain_and_streamed_carry_each_generated_token(url):
  body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2, "max_tokens": 3}
  r = _post(url, "/v1/chat/completions", body).json()
  n = len(url[1].encode("hi"))
  content = r["choices"][0]["logprobs"]["content"]
  assert [e["logprob"] for e in content] == [_lp(p).logprob for p in range(n, n + 3)]
  assert [len(e["top_logprobs"]) for e in content] == [2, 2, 2]
  with httpx.stream("POST", url[0] + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
    events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
  streamed = [e for ev in events for ch in ev["choices"] for e in (ch["logprobs"] or {}).get("content", [])]
  assert streamed == content


def test_tokenize_detokenize_and_tokenizer_info_in_vllms_shapes(url):
  r = _post(url, "/tokenize", {"prompt": "hello world"}).json()
  assert r == {"tokens": url[1].encode("hello world"), "count": len(r["tokens"]), "max_model_len": 64}
  chat = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "hello world"}]}).json()
  assert chat["tokens"] == r["tokens"]  # the test template renders the first message's content
  assert _post(url, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "hello world"}
  info = httpx.get(url[0] + "/tokenizer_info").json()  # lm-eval's remote-tokenizer probe reads eos_token
  assert info["eos_token"] == "</s>" and info["bos_token"] is None and info["model_max_length"] == 64
  bad = _post(url, "/detokenize", {"tokens": [1, 9999]})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_byte_level_tokens_report_their_own_bytes_and_keep_distinct_top_logprobs(url):
  from MaxText.server.logprobs import chat_logprobs, completion_logprobs
  tok = url[1]
  texts = Texts(tok, add_bos=False, vocab_size=tok.vocab_size, chat_template=None, chat_template_source="test",
                special_tokens={})
  ids = tok.encode("naïve — 日本")
  pieces = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
  assert len(pieces) >= 2 and b"".join(tok.token_bytes(i) for i in ids).decode() == "naïve — 日本"
  entries = [Logprob(-0.5, 1, [(pieces[0], -0.5), (pieces[1], -1.0)]) for _ in ids]
  content = chat_logprobs(texts, ids, entries)
  assert b"".join(bytes(e["bytes"]) for e in content) == "naïve — 日本".encode()  # each token's own bytes
  top = content[0]["top_logprobs"]
  assert [t["bytes"] for t in top] == [list(tok.token_bytes(pieces[0])), list(tok.token_bytes(pieces[1]))]
  assert top[0]["token"] != top[1]["token"] and all(t["token"].startswith("bytes:\\x") for t in top)
  legacy = completion_logprobs(texts, ids[:1], entries[:1])["top_logprobs"][0]
  assert len(legacy) == 3  # the two pieces and the token itself: distinct keys, not one "\ufffd"


def test_tokenizer_info_names_the_bos_the_server_prepends(url):
  from MaxText.server.logprobs import tokenizer_info
  tok = url[1]
  texts = lambda add_bos: Texts(tok, add_bos=add_bos, vocab_size=512, chat_template=None,  # noqa: E731
                                chat_template_source="test", special_tokens={"bos_token": "", "eos_token": "</s>"})
  assert tokenizer_info(texts(True), 64)["bos_token"] == "<s>" == tok.token_str(tok.bos_id)
  assert tokenizer_info(texts(False), 64)["bos_token"] is None  # nothing prepended: none to name
