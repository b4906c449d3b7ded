"""Which chat format renders conversations (`chat_format`: one decision for the server, SFT and RL), and
jinja chat templates (a tokenizer's `chat_template`, or chat_template_path): loaded and compiled as
transformers does, for the server's /v1/chat/completions (server/protocol.py) and for SFT (data/sft.py).

    fmt = chat_format(config)   # fmt.encoding "jinja" | "deepseek_v32", fmt.template, fmt.source, fmt.special
    template, where, special = load_chat_template(chat_template_path, tokenizer_path)
    pieces = render_pieces(template, messages, tools=None, special=special)   # [(role, text)], for SFT

Invariant of render_pieces: the texts concatenated are the whole conversation as the template renders
it (add_generation_prompt=false); an "assistant" piece is exactly what the template adds for one
assistant message after the prompt it renders for the messages before it (add_generation_prompt=true):
what the model writes when served with that template. Everything else is "prompt".
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any


class TemplateRenderError(ValueError):
  """The template rejected the messages, or its prefixes do not nest (SFT cannot find the assistant's span)."""


def load_chat_template(chat_template_path: str, tokenizer_path: str) -> tuple[str | None, str, dict[str, str]]:
  """-> (template or None, where it was looked for, {bos_token, eos_token} for the template).
  chat_template_path wins; else `chat_template` of the tokenizer_config.json next to tokenizer_path."""
  from MaxText.config.types import ConfigError
  special: dict[str, str] = {"bos_token": "", "eos_token": ""}
  folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
  cfg_path = os.path.join(folder, "tokenizer_config.json") if tokenizer_path else ""
  cfg: dict = {}
  if cfg_path and os.path.isfile(cfg_path):
    try:
      with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    except (OSError, ValueError) as e:
      raise ConfigError(f"{cfg_path} (next to tokenizer_path) is not valid JSON: {e}") from None
    for kind in ("bos_token", "eos_token"):
      tok = cfg.get(kind)
      special[kind] = (tok.get("content") if isinstance(tok, dict) else tok) or ""
  if chat_template_path:
    try:
      with open(chat_template_path, encoding="utf-8") as f:
        return f.read(), f"chat_template_path={chat_template_path}", special
    except OSError as e:
      raise ConfigError(f"chat_template_path='{chat_template_path}' is not readable: {e.strerror}") from None
  template = cfg.get("chat_template")
  if isinstance(template, list):  # transformers' named templates: [{"name": "default", "template": ...}]
    template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  where = f"looked in {cfg_path}" if cfg_path else "no tokenizer_path"
  return template or None, where, special


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """The format a run renders conversations in: the server's prompts, SFT's rows and RL's prompts alike."""
  encoding: str  # "deepseek_v32" (data/chat_dsv32.py) or "jinja" (the template)
  template: str | None  # the jinja source (None: none found)
  source: str  # where the template came from, or where it was looked for
  special: dict  # {bos_token, eos_token} for the template


def resolve_encoding(chat_encoding: str, has_template: bool, has_tokenizer: bool) -> str:
  """chat_encoding=auto: the jinja template when there is one, else DeepSeek-V3.2's format (the
  release ships no template) when there is a tokenizer; deepseek_v32 needs a tokenizer."""
  from MaxText.config.types import ConfigError
  if chat_encoding == "deepseek_v32" and not has_tokenizer:
    raise ConfigError("chat_encoding=deepseek_v32 needs tokenizer_path (the format is text: a tokenizer.json "
                      "holding its markers, e.g. DeepSeek-V3.2's or tests/data/tokenizer.json)")
  if chat_encoding == "auto":
    return "jinja" if has_template or not has_tokenizer else "deepseek_v32"
  return chat_encoding


def chat_format(config, has_tokenizer: bool | None = None) -> ChatFormat:
  """The one decision, from chat_encoding, chat_template_path and tokenizer_path (the chat_template of the
  tokenizer_config.json next to it): so SFT data is rendered in the format it is later served in.
  has_tokenizer: whether the caller holds a tokenizer (default: tokenizer_path is set)."""
  template, where, special = load_chat_template(config.chat_template_path, config.tokenizer_path)
  has_tokenizer = bool(config.tokenizer_path) if has_tokenizer is None else has_tokenizer
  return ChatFormat(resolve_encoding(config.chat_encoding, template is not None, has_tokenizer), template, where,
                    special)


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
  """As transformers compiles chat templates: a sandbox, trimmed blocks, loop controls, tojson,
  raise_exception and strftime_now."""
  import jinja2
  from jinja2.ext import loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    from MaxText.config.types import ConfigError
    raise ConfigError(f"the chat template does not compile (chat_template_path / tokenizer_config.json): {e}") from None


def _render(template: str, messages: list[dict], add_generation_prompt: bool, tools: Any, special: dict) -> str:
  import jinja2
  kw = {"tools": tools} if tools else {}
  try:
    return compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **kw, **special)
  except jinja2.TemplateError as e:
    raise TemplateRenderError(f"the chat template rejected the messages: {e}") from None


def render_pieces(template: str, messages: list[dict], *, tools: Any = None,
                  special: dict | None = None) -> list[tuple[str, str]]:
  """[(role "assistant" or "prompt", text)] of the conversation (module docstring): each assistant span is
  render(messages[:i + 1]) minus render(messages[:i], add_generation_prompt=True)."""
  special = special or {}
  whole = _render(template, messages, False, tools, special)
  pieces, done = [], 0  # done: characters of `whole` already in pieces
  for i, m in enumerate(messages):
    if m.get("role") != "assistant":
      continue
    prompt = _render(template, messages[:i], True, tools, special)
    upto = _render(template, messages[:i + 1], False, tools, special)
    if not (upto.startswith(prompt) and whole.startswith(upto) and len(prompt) >= done):
      raise TemplateRenderError(f"the chat template's rendering of messages[:{i}] (with the generation prompt) is "
                                f"not a prefix of messages[:{i + 1}] and of the whole: the assistant's span of "
                                f"messages[{i}] is undefined; SFT needs a template whose prefixes nest")
    pieces += [("prompt", whole[done:len(prompt)]), ("assistant", upto[len(prompt):])]
    done = len(upto)
  pieces.append(("prompt", whole[done:]))
  return [(role, text) for role, text in pieces if text]
