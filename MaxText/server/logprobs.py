"""Logprobs and token ids in OpenAI's and vLLM's response shapes, and /tokenize, /detokenize, /tokenizer_info.

The engine gives, per position, logprobs.Logprob(logprob, rank, top [(id, logprob)]) (MaxText/inference/
logprobs.py: the model's log-softmax before temperature, top_p and top_k). Here they become:
  /v1/completions `logprobs`: {"tokens": [text], "token_logprobs": [float | null], "top_logprobs":
    [{text: logprob} | null], "text_offset": [int]}: one entry per token of the choice's text (with
    `echo` the prompt's first: its first token's logprob and top are null); a top dict holds the top N
    and the token itself (vLLM's).
  vLLM's `prompt_logprobs`: [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...] per prompt token.
  /v1/chat/completions `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}]}.
A token's text is its own decode (its ids joined by commas without a tokenizer: the ids as text); a
token that is not whole UTF-8 characters (a byte-level piece of one) is "bytes:\\xe2\\x80" (OpenAI's
spelling), so distinct tokens keep distinct top_logprobs keys, and its chat `bytes` are its own bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict

from MaxText.server.protocol import ApiError, ChatMessage, ChatRequest, Texts


def token_text(texts: Texts, tok: int) -> str:
  """One token's own text (its id without a tokenizer; "bytes:\\x.." when it is part of a character)."""
  if texts.tokenizer is None:
    return str(tok)
  text = texts.tokenizer.decode([tok])
  if "\ufffd" not in text:
    return text
  own = texts.tokenizer.token_bytes(tok)
  try:
    return own.decode("utf-8")  # a token that is U+FFFD itself
  except UnicodeDecodeError:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in own)


def token_bytes(texts: Texts, tok: int) -> list[int]:
  """One token's own bytes (OpenAI's chat `bytes`): its text's, or for a piece of a character its raw bytes."""
  text = token_text(texts, tok) if texts.tokenizer is None else texts.tokenizer.decode([tok])
  return list(texts.tokenizer.token_bytes(tok) if "\ufffd" in text else text.encode("utf-8"))


def completion_logprobs(texts: Texts, tokens: Sequence[int], entries: Sequence[Any], offset: int = 0) -> dict:
  """OpenAI's completions logprobs for tokens and their Logprob entries (None: no logprob, the prompt's
  first); text_offset counts from `offset` (the characters of the choice's text before these)."""
  out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for tok, e in zip(tokens, entries):
    text = token_text(texts, tok)
    out["tokens"].append(text)
    out["token_logprobs"].append(None if e is None else e.logprob)
    top = None if e is None else {token_text(texts, i): v for i, v in e.top}
    if top is not None:
      top.setdefault(text, e.logprob)
    out["top_logprobs"].append(top)
    out["text_offset"].append(offset)
    offset += len(text)
  return out


def prompt_logprobs(texts: Texts, prompt: Sequence[int], entries: Sequence[Any]) -> list:
  """vLLM's prompt_logprobs: null for the first token, then {"<id>": {logprob, rank, decoded_token}} with
  the prompt token and the top N (ranks 1..N)."""
  out: list = []
  for tok, e in zip(prompt, entries):
    if e is None:
      out.append(None)
      continue
    d = {str(i): {"logprob": v, "rank": k + 1, "decoded_token": token_text(texts, i)} for k, (i, v) in enumerate(e.top)}
    d.setdefault(str(tok), {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(texts, tok)})
    out.append(d)
  return out


def chat_logprobs(texts: Texts, tokens: Sequence[int], entries: Sequence[Any]) -> list[dict]:
  """OpenAI's chat `logprobs.content` entries for tokens and their Logprob entries."""
  def one(tok: int, lp: float) -> dict:
    text = token_text(texts, tok)
    return {"token": text, "logprob": lp, "bytes": token_bytes(texts, tok)}
  return [{**one(tok, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
          for tok, e in zip(tokens, entries) if e is not None]


# ---------------------------------------------------------------- /tokenize, /detokenize (vLLM's shapes)


class TokenizeRequest(ChatRequest):
  """vLLM's /tokenize: a `prompt`, or `messages` with every field /v1/chat/completions renders them with
  (tools, tool_choice, chat_template_kwargs, response_format, add_generation_prompt, continue_final_message,
  ...): the ids are exactly the prompt ids that endpoint runs (its `return_token_ids`). add_special_tokens:
  BOS (add_bos) before a prompt unless false; before messages only when true (vLLM's defaults for each);
  return_token_strs: each id's vocabulary entry too."""
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: bool | None = None
  return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
  model_config = ConfigDict(extra="ignore")
  tokens: list[int]


def tokenize(texts: Texts, body: TokenizeRequest, chat_prompt, max_model_len: int) -> dict:
  """{"prompt"} or {"messages", chat fields} -> {"tokens", "count", "max_model_len"}; chat_prompt(body) ->
  ids renders the request as /v1/chat/completions does."""
  if (body.prompt is None) == (body.messages is None):
    raise ApiError(400, "give exactly one of prompt (a string) or messages (a chat)", "prompt")
  if body.messages is not None:
    body.check()
    ids = chat_prompt(body)
  else:
    ids = texts.prompts(body.prompt, body.add_special_tokens is not False)[0]
  out = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
  if body.return_token_strs:
    out["token_strs"] = [texts.tokenizer.token_str(i) if texts.tokenizer is not None else str(i) for i in ids]
  return out


def tokenizer_info(texts: Texts, max_model_len: int) -> dict:
  """vLLM's GET /tokenizer_info: what lm-evaluation-harness's local-completions reads to use the server's
  tokenizer through /tokenize and /detokenize (then it loads no tokenizer of its own). bos_token: the
  tokenizer_config.json's, else the BOS the server prepends (add_bos), else null."""
  special, tok = texts.special_tokens, texts.tokenizer
  bos = special.get("bos_token") or (tok.token_str(tok.bos_id) if tok is not None and texts.add_bos else None)
  return {"eos_token": special.get("eos_token") or None, "bos_token": bos,
          "pad_token": None, "model_max_length": max_model_len,
          "tokenizer_class": type(texts.tokenizer).__name__ if texts.tokenizer is not None else None}


def detokenize(texts: Texts, body: DetokenizeRequest) -> dict:
  """{"tokens"} -> {"prompt"}: their text (ids joined by commas without a tokenizer)."""
  bad = [t for t in body.tokens if not 0 <= t < texts.vocab_size]
  if bad:
    raise ApiError(400, f"tokens has ids {bad[:5]} outside [0, {texts.vocab_size})", "tokens")
  return {"prompt": texts.text_of(body.tokens)}


__all__ = ["token_text", "token_bytes", "completion_logprobs", "prompt_logprobs", "chat_logprobs", "TokenizeRequest",
           "DetokenizeRequest", "tokenize", "detokenize", "tokenizer_info"]
