"""OpenAI's wire format: request bodies, error bodies, and the text side of a request (prompts to ids,
stop strings, chat templates, ids to text).

Requests follow OpenAI's /v1/completions and /v1/chat/completions fields and vLLM's (its
ChatCompletionRequest, CompletionRequest and TokenizeRequest are the contract): the ones with a meaning
here are declared below (vLLM's `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`add_special_tokens`, `skip_special_tokens`, `add_generation_prompt`, `continue_final_message`, ...);
vLLM's others are accepted where they change nothing, or at their off value (server/vllm_fields.py); any
other name is a 400 naming it (extra="forbid"), except IGNORED: OpenAI's bookkeeping fields
(docs/sampling.md lists every kind). Every bad field is an `ApiError` whose `param` names it.

Without a tokenizer (a model trained on synthetic ids) a prompt is token ids and a choice's text
is its ids joined by commas, as decode.py prints them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

from pydantic import BaseModel, ConfigDict, model_validator

from MaxText.data.chat_template import compile_template, load_chat_template  # noqa: F401 (serve.py imports it here)
from MaxText.data.tokenizer import Tokenizer
from MaxText.inference.scheduler import SamplingParams
from MaxText.runtime.cli import FieldError
from MaxText.server import vllm_fields


class ApiError(Exception):
  """An error a client sees as OpenAI's body {"error": {"message", "type", "param", "code"}}."""

  TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
           503: "service_unavailable", 500: "internal_server_error"}

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  @classmethod
  def bad_field(cls, e: FieldError) -> ApiError:
    """A 400 naming the field a request, message or grammar error names (its `param`)."""
    return cls(400, str(e), e.field)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                      "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
  include_usage: bool = False


IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


class SamplingFields(BaseModel):
  """The fields both endpoints share (penalties, logit_bias, min_p, min_tokens: inference/penalties.py)."""
  model_config = ConfigDict(extra="forbid")
  model: str | None = None
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # vLLM: 0 or -1 = off
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  seed: int | None = None
  ignore_eos: bool = False
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = 1
  best_of: int | None = None  # OpenAI's (completions): candidates to pick the n best from; only best_of = n = 1
  return_token_ids: bool = False
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0  # vLLM's
  logit_bias: dict[str, float] | None = None  # {"<token id>": bias in [-100, 100]}
  min_p: float = 0.0  # vLLM's
  min_tokens: int = 0  # vLLM's: no stop (EOS, stop_token_ids, stop strings) before this many tokens
  include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it
  skip_special_tokens: bool = True  # vLLM's: False keeps BOS / EOS / PAD's text in the output text
  cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prompt pages
  truncate_prompt_tokens: int | None = None  # vLLM's: keep this many prompt tokens (-1: max_target_length)
  truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts: left keeps the last
  # OpenAI's fields that change nothing here (IGNORED): accepted, documented in docs/sampling.md
  user: str | None = None
  metadata: dict | None = None
  store: bool | None = None
  service_tier: str | None = None
  prompt_cache_key: str | None = None
  safety_identifier: str | None = None
  # Structured outputs (server/structured.py): OpenAI's, then vLLM's (and its older guided_*)
  response_format: dict | None = None
  structured_outputs: dict | None = None
  guided_json: dict | str | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None

  ENDPOINT: ClassVar[str] = "completions"  # which of vLLM's field lists (server/vllm_fields.py) the body takes

  @model_validator(mode="before")
  @classmethod
  def _null_is_default(cls, data):
    """Clients send null for a field they leave unset: it takes the default. vLLM's fields without a meaning
    here go (server/vllm_fields.py): accepted when they change nothing, else a 400 naming the field."""
    if not isinstance(data, dict):
      return data
    data, bad = vllm_fields.split({k: v for k, v in data.items() if v is not None}, cls.ENDPOINT)
    if bad is not None:
      raise ApiError(400, bad[1], bad[0])
    return data

  def check_logprobs(self, most: int) -> None:
    """400 naming the field when a logprobs count is outside [0, serve_max_logprobs]."""
    for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
      n = getattr(self, field, None)
      if isinstance(n, int) and not isinstance(n, bool) and not 0 <= n <= most:
        raise ApiError(400, f"{field}={n} is invalid: expected an integer in [0, {most}] (serve_max_logprobs)", field)

  def logprob_counts(self) -> tuple[int | None, int | None]:
    """(N for the generated tokens, N for the prompt's); None = not asked."""
    return None, None

  def truncated(self, prompt: list[int], max_length: int) -> list[int]:
    """A prompt's ids as truncate_prompt_tokens leaves them (vLLM's: the last k, or the first k with truncation_side
    "right"; -1 = max_target_length); a k outside -1, 1..max_length is a 400 naming the field."""
    k = self.truncate_prompt_tokens
    if k is None:
      return prompt
    if not (k == -1 or 1 <= k <= max_length):
      raise ApiError(400, f"truncate_prompt_tokens={k} is invalid: expected -1 (max_target_length) or an integer in "
                     f"[1, {max_length}]", "truncate_prompt_tokens")
    k = max_length if k == -1 else k
    return prompt[-k:] if self.truncation_side == "left" else prompt[:k]

  def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs; a key that is not an integer is a 400 naming logit_bias."""
    pairs = []
    for k, v in (self.logit_bias or {}).items():
      try:
        pairs.append((int(k), float(v)))
      except ValueError:
        raise ApiError(400, f"logit_bias has key {k!r}: keys are token ids (integers as strings)",
                       "logit_bias") from None
    return tuple(pairs)

  def check(self) -> None:
    if self.n < 1:
      raise ApiError(400, f"n={self.n} is invalid: expected an integer >= 1", "n")
    if self.n != 1:
      raise ApiError(400, f"n={self.n} is not supported: only n=1 (send the request again for more choices)", "n")
    if self.best_of is not None and self.best_of < self.n:
      raise ApiError(400, f"best_of={self.best_of} is invalid: expected an integer >= n={self.n}", "best_of")
    if self.best_of not in (None, 1):
      raise ApiError(400, f"best_of={self.best_of} is not supported: only best_of=1 (the one choice made)", "best_of")
    if self.stream_options is not None and not self.stream:
      raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= 1024:
      raise ApiError(400, f"cache_salt has {len(self.cache_salt)} characters: expected 1 to 1024", "cache_salt")

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage

  @property
  def stop_strings(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
  prompt: str | list[int] | list[str] | list[list[int]]
  max_tokens: int | None = 16  # OpenAI's default for completions; 0 with echo: score the prompt only
  logprobs: int | None = None  # each token's logprob and the top N (server/logprobs.py)
  echo: bool = False  # the prompt in the text (with logprobs: its tokens' logprobs too)
  prompt_logprobs: int | None = None  # vLLM's: every prompt token's logprob and the top N
  add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS (add_bos); False: none

  def check(self) -> None:
    super().check()
    if self.max_tokens == 0 and not self.echo:
      raise ApiError(400, "max_tokens=0 is only allowed with echo=true (scoring the prompt)", "max_tokens")

  def logprob_counts(self) -> tuple[int | None, int | None]:
    """(N for the generated tokens, N for the prompt's) as the engine's SamplingParams take them."""
    prompt_n = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
    return self.logprobs, max(prompt_n) if prompt_n else None


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="allow")
  role: str
  content: str | list[dict] | None = None

  def text(self) -> str:
    """The content as one string (OpenAI's list of parts: the text parts, joined)."""
    if isinstance(self.content, list):
      bad = [p.get("type") for p in self.content if p.get("type") != "text"]
      if bad:
        raise ApiError(400, f"content parts of type {bad[0]!r} are not supported: only 'text'", "messages")
      return "".join(str(p.get("text", "")) for p in self.content)
    return self.content or ""

  def as_dict(self) -> dict:
    """The message as a chat renderer reads it: every field given, content as one string."""
    return {**self.model_dump(exclude_none=True), "content": self.text()}


class ChatRequest(SamplingFields):
  ENDPOINT: ClassVar[str] = "chat"
  messages: list[ChatMessage]
  max_completion_tokens: int | None = None
  # vLLM's rendering fields (server/chat.py): the generation prompt (default: on unless continue_final_message),
  # the last message left open for the reply to continue, BOS on top of the template's, and the last message's
  # text before the reply's (echo: when the reply continues that message)
  add_generation_prompt: bool | None = None
  continue_final_message: bool = False
  add_special_tokens: bool | None = False
  echo: bool = False
  documents: list[dict] | None = None  # a jinja template's `documents` (RAG); DeepSeek-V3.2's format has none
  reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # thinking on
  # unless "none" (as vLLM's enable_thinking), where chat_template_kwargs does not say
  include_reasoning: bool = True  # False: the reply's reasoning is not returned (vLLM's)
  # Read by the DeepSeek-V3.2 format (MaxText/server/chat.py); the jinja path ignores them.
  tools: list[Any] | None = None
  tool_choice: str | dict | None = None
  parallel_tool_calls: bool = True
  chat_template_kwargs: dict | None = None  # {"thinking": true} (or "enable_thinking")

  logprobs: bool = False  # each generated token's logprob (server/logprobs.py)
  top_logprobs: int | None = None  # and the top N (needs logprobs=true)

  def logprob_counts(self) -> tuple[int | None, int | None]:
    return (self.top_logprobs or 0) if self.logprobs else None, None

  def check(self) -> None:
    super().check()
    if self.top_logprobs is not None and not self.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    if not self.messages:
      raise ApiError(400, "messages is empty: give at least one message", "messages")
    if self.continue_final_message and self.add_generation_prompt:
      raise ApiError(400, "continue_final_message and add_generation_prompt are both true: the reply either continues "
                     "the last message or starts a new one", "continue_final_message")

  @property
  def generation_prompt(self) -> bool:
    return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt


# ---------------------------------------------------------------- the text side of a request


class Texts:
  """The server's tokenizer (or none) and chat template: prompts to ids, stop strings, ids to text.
  chat_encoding: "jinja" (chat_prompt renders the template) or "deepseek_v32" (server/chat.py); thinking:
  DeepSeek-V3.2's mode for a request that does not say (chat_thinking, as SFT and RL default)."""

  def __init__(self, tokenizer: Tokenizer | None, *, add_bos: bool, vocab_size: int, chat_template: str | None,
               chat_template_source: str, special_tokens: dict[str, str], chat_encoding: str = "jinja",
               thinking: bool = False):
    self.tokenizer, self.add_bos, self.vocab_size, self.thinking = tokenizer, add_bos, vocab_size, thinking
    self.chat_encoding = chat_encoding
    self.chat_template_source = chat_template_source
    self._special = special_tokens
    self._template = compile_template(chat_template) if chat_template else None

  @property
  def special_tokens(self) -> dict[str, str]:
    """{bos_token, eos_token}: their text from the tokenizer_config.json ("" when it names none)."""
    return dict(self._special)

  def prompts(self, prompt: Any, special: bool = True) -> list[list[int]]:
    """A completions `prompt` (a string, token ids, or a list of either) -> ids per prompt; special
    (vLLM's add_special_tokens): a text prompt gets BOS when add_bos asks for it (token ids go as sent)."""
    bos = None if special else False
    if isinstance(prompt, str):
      return [self.encode(prompt, bos=bos)]
    if prompt and all(isinstance(p, int) for p in prompt):
      return [list(prompt)]
    if not prompt:
      raise ApiError(400, "prompt is empty", "prompt")
    return [self.encode(p, bos=bos) if isinstance(p, str) else list(p) for p in prompt]

  def encode(self, text: str, *, bos: bool | None = None) -> list[int]:
    """text -> ids, BOS first when add_bos (or `bos`) asks for it and the text does not already start
    with the BOS token itself (a prompt rendered with its BOS, as lm-evaluation-harness and chat
    renderers send, keeps one BOS, not two)."""
    if self.tokenizer is None:
      raise ApiError(400, "prompt must be token ids (a list of integers): the server has no tokenizer_path", "prompt")
    ids = self.tokenizer.encode(text)
    add = (self.add_bos if bos is None else bos) and ids[:1] != [self.tokenizer.bos_id]
    return ([self.tokenizer.bos_id] if add else []) + ids

  def chat_prompt(self, messages: Sequence[ChatMessage], *, generation_prompt: bool = True,
                  continue_final: bool = False, special: bool = False, kwargs: dict | None = None) -> list[int]:
    """The messages rendered by the chat template (as transformers' apply_chat_template), tokenized.
    continue_final: the text ends where the last message's content does (its end-of-turn cut off), so the
    reply continues it; special (vLLM's add_special_tokens): BOS on top of the template's (add_bos; never two);
    kwargs: the template's further variables (chat_template_kwargs, documents, reasoning_effort)."""
    if self._template is None:
      raise ApiError(400, "no chat template: set chat_template_path=<a jinja2 file>, or put chat_template in "
                     f"the tokenizer_config.json next to tokenizer_path ({self.chat_template_source})",
                     "chat_template_path")
    import jinja2
    try:
      text = self._template.render(**(kwargs or {}), messages=[m.as_dict() for m in messages],
                                   add_generation_prompt=generation_prompt, **self._special)
    except jinja2.TemplateError as e:
      raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    if continue_final:
      text = _open_final(text, messages[-1].text())
    return self.encode(text, bos=None if special else False)  # the template writes BOS itself when the model wants one

  def stop_plan(self, stops: Sequence[str], stop_token_ids: Sequence[int] | None,
                keep_stop: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """-> (token ids the engine stops on, those of them that are single-token stop strings). A stop
    string that is one token is both: the engine stops at once (from min_tokens on: never banned, as
    vLLM's stop strings), the text check catches other spellings; not with keep_stop
    (include_stop_str_in_output: the engine would drop the token whose text must stay)."""
    ids = list(stop_token_ids or [])
    if stops and self.tokenizer is None:
      raise ApiError(400, "stop strings need a tokenizer (the server has no tokenizer_path): use stop_token_ids",
                     "stop")
    strings = []
    for s in stops:
      if not s:
        raise ApiError(400, "stop has an empty string", "stop")
      one = self.tokenizer.encode(s)
      if len(one) == 1 and self.tokenizer.decode(one) == s and not keep_stop and one[0] not in ids:
        strings.append(one[0])
    return tuple(dict.fromkeys(ids + strings)), tuple(dict.fromkeys(strings))

  def sampling(self, body: SamplingFields, prompt: Sequence[int], max_tokens: int | None,
               stop_ids: tuple[tuple[int, ...], tuple[int, ...]], max_length: int) -> SamplingParams:
    """The engine's SamplingParams; max_tokens None = the rest of the context (max_target_length); stop_ids:
    stop_plan's."""
    if len(prompt) >= max_length:
      raise ApiError(400, f"prompt has {len(prompt)} tokens: the context (max_target_length={max_length}) leaves "
                     "no room to generate", "prompt")
    logprobs, prompt_logprobs = body.logprob_counts()
    return SamplingParams(max_tokens=max_length - len(prompt) if max_tokens is None else max_tokens,
                          temperature=body.temperature, top_p=body.top_p, top_k=0 if body.top_k == -1 else body.top_k,
                          stop_token_ids=stop_ids[0], stop_string_ids=stop_ids[1], ignore_eos=body.ignore_eos, seed=body.seed,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias_pairs(),
                          min_p=body.min_p, min_tokens=body.min_tokens, cache_salt=body.cache_salt or "")

  def text_of(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Token ids as text (joined by commas without a tokenizer); skip_special False (vLLM's
    skip_special_tokens): BOS, EOS and PAD as their own text too."""
    if self.tokenizer is None:
      return ",".join(map(str, ids))
    return (self.tokenizer if skip_special else _KeepSpecial(self.tokenizer)).decode(ids)

  def detokenizer(self, prompt: Sequence[int], skip_special: bool = True):
    """-> an object with push(token id) -> the text it adds, and flush() -> the text held back at the
    end (incremental detokenization; ids joined by commas without a tokenizer); skip_special as text_of's."""
    if self.tokenizer is None:
      return _IdsText()
    from MaxText.data.tokenizer import TextStreamer
    return TextStreamer(self.tokenizer if skip_special else _KeepSpecial(self.tokenizer), prompt)


def _open_final(text: str, final: str) -> str:
  """A rendered chat cut right after its last message's content (transformers' continue_final_message)."""
  for content in (final, final.strip()):
    if content and content in text:
      return text[:text.rindex(content) + len(content)]
  raise ApiError(400, "continue_final_message: the chat template's text does not hold the last message's content "
                 "(an empty message has nothing to continue)", "continue_final_message")


class _KeepSpecial:
  """A tokenizer's decode that keeps the special tokens it drops (BOS, EOS, PAD) as their vocabulary text."""

  def __init__(self, tokenizer: Tokenizer):
    self._tok = tokenizer
    self._special = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}

  def decode(self, ids: Sequence[int]) -> str:
    out, run = [], []
    for i in map(int, ids):
      if i in self._special:
        out += [self._tok.decode(run), self._tok.token_str(i)]
        run = []
      else:
        run.append(i)
    return "".join(out + [self._tok.decode(run)])


class _IdsText:
  """A choice's text without a tokenizer: its ids joined by commas, as decode.py prints them."""

  def __init__(self):
    self._first = True

  def push(self, tok: int) -> str:
    sep = "" if self._first else ","
    self._first = False
    return f"{sep}{tok}"

  def flush(self) -> str:
    return ""


class StopText:
  """Finds stop strings in streamed text: push(piece) -> (text safe to send, stopped). Holds back
  the last len(longest stop) - 1 characters, so a stop split over pieces is never half sent; the
  text sent ends before the first stop string (with keep: after it, vLLM's include_stop_str_in_output)."""

  def __init__(self, stops: Sequence[str], keep: bool = False):
    self.stops, self.keep = list(stops), keep
    self._hold = max((len(s) for s in self.stops), default=1) - 1
    self._pending = ""

  def push(self, piece: str) -> tuple[str, bool]:
    self._pending += piece
    hits = [(i, i + len(s)) for s, i in ((s, self._pending.find(s)) for s in self.stops) if i >= 0]
    if hits:
      start, end = min(hits)
      out, self._pending = self._pending[:end if self.keep else start], ""
      return out, True
    cut = max(len(self._pending) - self._hold, 0)
    out, self._pending = self._pending[:cut], self._pending[cut:]
    return out, False

  def flush(self) -> str:
    out, self._pending = self._pending, ""
    return out
