"""Every request field docs/sampling.md documents, each ALONE (no other field beside it), through the real
server (app, uvicorn, engine thread, ServingEngine) on the tiny model at random init: /v1/completions and
/v1/chat/completions, plain and streamed, each answers 200 with its effect asserted, or the documented 400
naming it. A field is seen from the first token on (a penalty before any output, min_tokens once reached), at
the default temperature 1 (sampled) and, where the effect needs a fixed output, at temperature 0 beside the
greedy output of the same prompt. One server for the module (its step programs compile once).

Fixed outputs without a second field: min_p 1, top_k 1 and a tiny top_p keep only the argmax, so a sampled
request equals the greedy one; a +100 logit_bias makes every token that id; the prompt's side of the rendering
fields (add_special_tokens, add_generation_prompt, continue_final_message, documents, chat_template_kwargs,
reasoning_effort) shows in usage.prompt_tokens."""

import json
import os
import re
import shutil

import httpx
import pytest

from MaxText.server.in_process import serve_in_thread
from tests.conftest import REPO_ROOT, make_config
from tests.support.server_harness import wait_for

PROMPT = "I love to"
CHAT = [{"role": "user", "content": "hi"}]
CONTINUE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The sea"}]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% for d in documents or [] %}[doc]{{ d.text }}\n{% endfor %}{% if greeting %}{{ greeting }}{% endif %}"
            "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEYS = dict(max_target_length=48, param_init_std=0.2, mtp_num_layers=0, serve_page_size=8, serve_max_num_seqs=2,
            serve_max_num_tokens=32, prefill_chunk_size=16, serve_width_buckets=1, serve_context_buckets=1,
            tokenizer_type="hf")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(ask, tokenizer, base): the server in a thread; ask(endpoint, body, stream) -> a result (below); base: the
  greedy answer of each endpoint's plain request (text, token ids, usage)."""
  from MaxText.serve import create_server
  tmp = tmp_path_factory.mktemp("fields")
  shutil.copy(os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json"), tmp / "tokenizer.json")
  (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
  cfg = make_config(**KEYS, tokenizer_path=str(tmp / "tokenizer.json"))
  server, app = create_server(cfg, log=lambda line: None)
  with serve_in_thread(app) as (url, _), httpx.Client(base_url=url, timeout=300) as client:
    wait_for(lambda: server.engine.ready, "the engine to compile", timeout=600)
    ask = lambda endpoint, body, stream=False: _ask(client, endpoint, body, stream)  # noqa: E731
    base = {e: ask(e, {**_body(e), "temperature": 0, "return_token_ids": True}) for e in ("completions", "chat")}
    yield ask, server.texts.tokenizer, base, client


def _body(endpoint: str, messages=CHAT) -> dict:
  return {"prompt": PROMPT} if endpoint == "completions" else {"messages": messages}


def _ask(client, endpoint: str, body: dict, stream: bool) -> dict:
  """One request -> {"status", "error" (OpenAI's body's error, or None), "text", "finish", "usage", "tokens"
  (token_ids when sent), "logprobs" (per-token entries), "prompt_logprobs"}; streamed: the events joined."""
  path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
  out = {"text": "", "finish": None, "usage": None, "tokens": [], "logprobs": [], "prompt_logprobs": None,
         "error": None, "stream": stream, "pieces": 0}
  if not stream:
    r = client.post(path, json=body)
    out["status"] = r.status_code
    if r.status_code != 200:
      return out | {"error": r.json()["error"]}
    events = [r.json()]
  else:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
      out["status"] = r.status_code
      if r.status_code != 200:
        return out | {"error": json.loads(r.read())["error"]}
      lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
  for ev in events:
    if "error" in ev:
      out["error"] = ev["error"]
    out["usage"] = ev.get("usage") or out["usage"]
    for c in ev.get("choices", []):
      out["pieces"] += 1
      part = c.get("text", "") if endpoint == "completions" else (c.get("message") or c.get("delta") or {}).get("content")
      out["text"] += part or ""
      out["finish"] = c.get("finish_reason") or out["finish"]
      out["tokens"] += c.get("token_ids") or []
      lp = c.get("logprobs")
      out["logprobs"] += (lp or {}).get("tokens" if endpoint == "completions" else "content") or []
      out["prompt_logprobs"] = c.get("prompt_logprobs", out["prompt_logprobs"])
  return out


def _ok(r: dict) -> dict:
  assert r["status"] == 200 and r["error"] is None, r
  return r


def _refused(r: dict, param: str) -> None:
  assert r["status"] == 400 and r["error"]["param"] == param, r
  assert param in r["error"]["message"] and r["error"]["type"] == "invalid_request_error", r


# ---------------------------------------------------------------- the matrix: (id, fields, endpoints, check)
# fields: a dict, or (tokenizer, the endpoint's greedy answer) -> a dict; check(result, endpoint, (ask, tokenizer, base)) asserts the field's effect.


def _ok(r: dict) -> dict:
  assert r["status"] == 200 and r["error"] is None, r
  return r


def _refuses(param):
  def check(r, e, ctx):
    assert r["status"] == 400 and r["error"]["param"] == param, r
    assert param in r["error"]["message"] and r["error"]["type"] == "invalid_request_error", r
  return check


def _plain(r, e, ctx):
  _ok(r)


def _greedy(r, e, ctx):
  """The kept set is the argmax alone: the sampled request's text is the greedy one's."""
  assert _ok(r)["text"] == ctx[2][e]["text"], (r["text"], ctx[2][e]["text"])


def _not_greedy(r, e, ctx):
  """A penalty changes the greedy output (it repeats tokens: a random model's does)."""
  base = ctx[2][e]
  assert len(set(base["tokens"])) < len(base["tokens"]), base  # the premise
  assert _ok(r)["text"] != base["text"], r["text"]


def _count(r) -> int | None:
  return r["usage"]["completion_tokens"] if r["usage"] else None


def _every_token_a(r, e, ctx):
  n = _count(_ok(r)) or len(r["text"])
  assert r["text"] == ctx[1].decode(_a(ctx[1]) * n), r["text"]


def _at_least(n):
  def check(r, e, ctx):
    assert (_count(_ok(r)) or n) >= n, r["usage"]
  return check


def _at_most(n):
  def check(r, e, ctx):
    assert (_count(_ok(r)) or 0) <= n and r["pieces"] <= n + 1, r  # streamed: a piece a token, then the last
  return check


def _holds(predicate):
  def check(r, e, ctx):
    assert predicate(_ok(r)), r
  return check


def _prompt(messages=CHAT, special=False, until=None, **variables):
  """usage.prompt_tokens is the template rendered by jinja2 here (not the server's code; cut after `until`),
  tokenized (with BOS when special): the rendering fields' effect on the prompt."""
  import jinja2
  text = jinja2.Environment().from_string(TEMPLATE).render(messages=messages, **variables)
  text = text if until is None else text[:text.rindex(until) + len(until)]

  def check(r, e, ctx):
    if _ok(r)["usage"] is not None:
      assert r["usage"]["prompt_tokens"] == len(ctx[1].encode(text)) + special, (r["usage"], text)
  return check


def _status(code, param):
  def check(r, e, ctx):
    assert r["status"] == code and r["error"]["param"] == param, r
  return check


def _one_token_less(r, e, ctx):
  """add_special_tokens false: the text prompt without its BOS."""
  assert _ok(r)["usage"] is None or r["usage"]["prompt_tokens"] == ctx[2][e]["usage"]["prompt_tokens"] - 1, r


def _stopped_at(n):
  """The greedy output up to its n-th token (the stop token not in the text), finish_reason stop."""
  def check(r, e, ctx):
    assert _ok(r)["text"] == ctx[1].decode(ctx[2][e]["tokens"][:n]) and r["finish"] == "stop", r
  return check


def _a(tok) -> list[int]:
  return tok.encode("a")


def _stream_usage(r, e, ctx):
  if r["stream"]:
    assert _ok(r)["usage"]["completion_tokens"] > 0, r
  else:
    _refuses("stream_options")(r, e, ctx)


def _logprobs(r, e, ctx):
  assert len(_ok(r)["logprobs"]) == (_count(r) or len(r["logprobs"])) > 0, r


def _prompt_logprobs(r, e, ctx):
  lps = _ok(r)["prompt_logprobs"]
  assert lps[0] is None and len(lps) == ctx[2][e]["usage"]["prompt_tokens"], lps


CHOICES = ("yes", "no")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CASES = [
  ("logit_bias", lambda tok, base: {"logit_bias": {str(_a(tok)[0]): 100}}, "both", _every_token_a),
  ("min_tokens", {"min_tokens": 5}, "both", _at_least(5)),
  ("presence_penalty", {"presence_penalty": 2.0}, "both", _plain),
  ("presence_penalty_negative", {"presence_penalty": -2.0}, "both", _plain),
  ("frequency_penalty", {"frequency_penalty": 2.0}, "both", _plain),
  ("repetition_penalty", {"repetition_penalty": 2.0}, "both", _plain),
  ("presence_penalty_greedy", {"temperature": 0, "presence_penalty": 2.0}, "both", _not_greedy),
  ("frequency_penalty_greedy", {"temperature": 0, "frequency_penalty": 2.0}, "both", _not_greedy),
  ("repetition_penalty_greedy", {"temperature": 0, "repetition_penalty": 2.0}, "both", _not_greedy),
  ("repetition_penalty_0", {"repetition_penalty": 0}, "both", _refuses("repetition_penalty")),  # logit / 0
  ("presence_penalty_over", {"presence_penalty": 2.5}, "both", _refuses("presence_penalty")),
  ("min_p_over", {"min_p": 1.5}, "both", _refuses("min_p")),
  ("logit_bias_not_an_id", {"logit_bias": {"x": 1}}, "both", _refuses("logit_bias")),
  ("min_tokens_over_max_tokens", {"min_tokens": 99}, "completions", _refuses("min_tokens")),
  ("temperature_0", {"temperature": 0}, "both", _greedy),
  ("temperature", {"temperature": 0.5}, "both", _plain),
  ("min_p_1", {"min_p": 1.0}, "both", _greedy),
  ("top_k_1", {"top_k": 1}, "both", _greedy),
  ("top_k_off", {"top_k": -1}, "both", _plain),
  ("top_k_negative", {"top_k": -2}, "both", _refuses("top_k")),  # vLLM's: -1 or 0 is off, below is an error
  ("top_p_tiny", {"top_p": 1e-6}, "both", _greedy),
  ("seed", {"seed": 7}, "both", _plain),
  ("stop", {"stop": ["e"]}, "both", _holds(lambda r: "e" not in r["text"])),
  ("stop_token_ids", lambda tok, base: {"stop_token_ids": _a(tok)}, "both", _plain),
  ("stop_token_ids_greedy", lambda tok, base: {"temperature": 0, "stop_token_ids": [base["tokens"][3]]}, "both",
   _stopped_at(3)),
  ("ignore_eos", {"ignore_eos": True}, "both", _holds(lambda r: r["finish"] == "length")),
  ("include_stop_str_in_output", {"include_stop_str_in_output": True}, "both", _plain),
  ("max_tokens", {"max_tokens": 3}, "both", _at_most(3)),
  ("max_completion_tokens", {"max_completion_tokens": 3}, "chat", _at_most(3)),
  ("n_1", {"n": 1}, "both", _plain),
  ("n_2", {"n": 2}, "both", _refuses("n")),
  ("best_of_1", {"best_of": 1}, "completions", _plain),
  ("best_of_2", {"best_of": 2}, "completions", _refuses("best_of")),
  ("stream_options", {"stream_options": {"include_usage": True}}, "both", _stream_usage),
  ("logprobs_completions", {"logprobs": 2}, "completions", _logprobs),
  ("logprobs_chat", {"logprobs": True}, "chat", _logprobs),
  ("top_logprobs_alone", {"top_logprobs": 2}, "chat", _refuses("top_logprobs")),
  ("prompt_logprobs", {"prompt_logprobs": 1}, "completions", _prompt_logprobs),
  ("echo_completions", {"echo": True}, "completions", _holds(lambda r: r["text"].startswith(PROMPT))),
  ("return_token_ids", {"return_token_ids": True}, "both", _holds(lambda r: r["tokens"])),
  ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
      "enum": list(CHOICES)}}}}, "both", _holds(lambda r: json.loads(r["text"]) in CHOICES)),
  ("structured_outputs", {"structured_outputs": {"choice": list(CHOICES)}}, "both", _holds(lambda r: r["text"] in CHOICES)),
  ("guided_choice", {"guided_choice": list(CHOICES)}, "both", _holds(lambda r: r["text"] in CHOICES)),
  ("guided_regex", {"guided_regex": "[ab]{3}"}, "both", _holds(lambda r: re.fullmatch("[ab]{3}", r["text"]))),
  ("guided_json", {"guided_json": {"enum": [1, 2]}}, "both", _holds(lambda r: json.loads(r["text"]) in (1, 2))),
  ("tools", {"tools": TOOLS}, "chat", _plain),  # the jinja path renders no tools (docs/sampling.md)
  ("tool_choice", {"tool_choice": "none"}, "chat", _plain),
  ("parallel_tool_calls", {"parallel_tool_calls": False}, "chat", _plain),
  ("chat_template_kwargs", {"chat_template_kwargs": {"greeting": "hello"}}, "chat",
   _prompt(greeting="hello", add_generation_prompt=True)),
  ("model", {"model": "deepseek3.2-tiny"}, "both", _plain),
  ("model_unknown", {"model": "nope"}, "both", _status(404, "model")),
  *((f"openai_{k}", {k: v}, "both", _plain) for k, v in (("user", "u"), ("metadata", {"k": "v"}), ("store", False),
                                                          ("service_tier", "auto"), ("prompt_cache_key", "k"),
                                                          ("safety_identifier", "s"))),
  ("add_special_tokens_completions", {"add_special_tokens": False}, "completions", _one_token_less),
  ("add_special_tokens_chat", {"add_special_tokens": True}, "chat", _prompt(special=True, add_generation_prompt=True)),
  ("add_generation_prompt", {"add_generation_prompt": False}, "chat", _prompt(add_generation_prompt=False)),
  ("continue_final_message", {"messages": CONTINUE, "continue_final_message": True}, "chat",
   _prompt(CONTINUE, until="The sea", add_generation_prompt=False)),
  ("echo_chat", {"messages": CONTINUE, "echo": True}, "chat", _holds(lambda r: r["text"].startswith("The sea"))),
  ("documents", {"documents": [{"title": "t", "text": "sea"}]}, "chat",
   _prompt(documents=[{"title": "t", "text": "sea"}], add_generation_prompt=True)),
  ("reasoning_effort", {"reasoning_effort": "high"}, "chat", _prompt(enable_thinking=True, add_generation_prompt=True)),
  ("reasoning_effort_none", {"reasoning_effort": "none"}, "chat", _prompt(add_generation_prompt=True)),
  ("skip_special_tokens", {"skip_special_tokens": False}, "both", _plain),
  ("include_reasoning", {"include_reasoning": False}, "chat", _plain),
  ("cache_salt", {"cache_salt": "team-a"}, "both", _plain),
  ("truncate_prompt_tokens", {"truncate_prompt_tokens": 3}, "both", _holds(lambda r: r["usage"] is None
                                                                             or r["usage"]["prompt_tokens"] == 3)),
  ("truncate_prompt_tokens_0", {"truncate_prompt_tokens": 0}, "both", _refuses("truncate_prompt_tokens")),
  ("truncation_side", {"truncation_side": "right"}, "both", _plain),  # nothing to cut without truncate_prompt_tokens
  *((f"vllm_{k}", {k: v}, "both", _plain) for k, v in (("request_id", "r1"), ("spaces_between_special_tokens", False),
                                                        ("stream_interval", 4), ("use_beam_search", False),
                                                        ("priority", 0), ("length_penalty", 1.0))),
  ("vllm_off_set", {"use_beam_search": True}, "both", _refuses("use_beam_search")),
  ("logits_processors_off", {"logits_processors": []}, "both", _plain),
  ("logits_processors", {"logits_processors": ["my.Processor"]}, "both", _refuses("logits_processors")),
  ("structural_tag", {"structural_tag": "{}"}, "chat", _refuses("structural_tag")),
  ("chat_template", {"chat_template": "{{ messages }}"}, "chat", _refuses("chat_template")),
  ("suffix", {"suffix": "!"}, "completions", _refuses("suffix")),
  ("not_vllms", {"functions": []}, "both", _refuses("functions")),
]


def _cases() -> list:
  return [pytest.param(fields, e, stream, check, id=f"{cid}-{e}-{'stream' if stream else 'plain'}")
          for cid, fields, endpoints, check in CASES
          for e in (("completions", "chat") if endpoints == "both" else (endpoints,)) for stream in (False, True)]


@pytest.mark.parametrize("fields,endpoint,stream,check", _cases())
def test_each_field_alone_answers_with_its_effect(served, fields, endpoint, stream, check):
  ask, tok, base, _ = served
  body = {**_body(endpoint), **(fields(tok, base[endpoint]) if callable(fields) else fields)}
  check(ask(endpoint, body, stream), endpoint, served)


def test_min_tokens_holds_a_single_token_stop_string_back_without_banning_it(served):
  """vLLM bans only EOS and stop_token_ids before min_tokens; a stop string is merely looked for from then on. A
  one-token stop string the greedy output makes at position k: without min_tokens the text stops before it;
  with min_tokens k + 2 the output is the greedy one through it (the token was not set to -inf)."""
  ask, tok, base, _ = served
  ids = base["completions"]["tokens"]
  k, s = next((k, tok.decode([t])) for k, t in enumerate(ids) if k and tok.encode(tok.decode([t])) == [t]
              and tok.decode([t]) not in tok.decode(ids[:k]))
  plain = {**_body("completions"), "temperature": 0, "stop": [s]}
  for stream in (False, True):
    r = _ok(ask("completions", plain, stream))
    assert r["text"] == tok.decode(ids[:k]) and r["finish"] == "stop", (r, s)
    r = _ok(ask("completions", {**plain, "min_tokens": k + 2}, stream))
    assert r["text"].startswith(tok.decode(ids[:k + 1])), (r, s, k)


def test_skip_special_tokens_false_keeps_bos_text_a_logit_bias_forces(served):
  ask, tok, _, _ = served
  for e in ("completions", "chat"):
    body = {**_body(e), "max_tokens": 3, "logit_bias": {str(tok.bos_id): 100}}
    assert _ok(ask(e, body))["text"] == ""  # the default: BOS is skipped
    assert _ok(ask(e, {**body, "skip_special_tokens": False}))["text"] == tok.token_str(tok.bos_id) * 3


@pytest.mark.parametrize("fields", [{}, {"add_generation_prompt": False}, {"add_special_tokens": True},
                                    {"messages": CONTINUE, "continue_final_message": True},
                                    {"documents": [{"text": "sea"}]}, {"reasoning_effort": "high"}])
def test_tokenize_takes_the_rendering_fields_and_gives_the_ids_chat_runs(served, fields):
  """vLLM's TokenizeRequest: /tokenize of messages is exactly /v1/chat/completions' prompt (its prompt_token_ids),
  field by field; return_token_strs spells each id."""
  ask, tok, _, client = served
  body = {"messages": CHAT, **fields}
  ids = client.post("/tokenize", json=body).json()["tokens"]
  chat = _ok(ask("chat", {**body, "max_tokens": 1, "return_token_ids": True}))
  assert ids == client.post("/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}).json()[
      "prompt_token_ids"] and len(ids) == chat["usage"]["prompt_tokens"]
  strs = client.post("/tokenize", json={**body, "return_token_strs": True}).json()["token_strs"]
  assert strs == [tok.token_str(i) for i in ids]


def test_tokenize_a_prompt_adds_bos_unless_add_special_tokens_is_false(served):
  _, tok, _, client = served
  with_bos = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
  assert with_bos == [tok.bos_id] + tok.encode(PROMPT)
  assert client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == with_bos[1:]
  r = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True})
  assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_truncate_prompt_tokens_keeps_the_last_k_or_with_truncation_side_right_the_first(served):
  _, tok, _, client = served
  ids = [tok.bos_id] + tok.encode(PROMPT)
  for side, want in (("left", ids[-3:]), ("right", ids[:3])):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True,
                                             "truncate_prompt_tokens": 3, "truncation_side": side}).json()
    assert r["prompt_token_ids"] == want, (side, r)
