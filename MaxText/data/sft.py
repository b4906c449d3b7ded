"""SFT data: one conversation -> token ids and per-token loss weights, in DeepSeek-V3.2's chat format.

    encoder = ConversationEncoder.from_config(config, tokenizer)
    doc = encoder(record, where="data/train.jsonl:7")   # (ids int32 [n], mask float32 [n]), or None: too long

A record (use_sft=true, `train_data_columns`) is a JSON object (a jsonl line, an ArrayRecord record
of UTF-8 JSON, a Parquet / HF row) holding either
  [messages]:           OpenAI-style messages: system, developer, user, assistant (content,
                        reasoning_content, tool_calls), tool (content, tool_call_id);
  [prompt, completion]: a string (a user turn / an assistant reply) or a list of messages each;
and optionally "tools" (OpenAI's tool list, rendered into the system prompt) and "thinking" (bool;
default: true when an assistant message has reasoning_content).

The text is chat_dsv32.render_pieces (the one renderer the server uses too), tokenized piece by
piece. Invariant: mask[i] is the weight of predicting token i: 1 on every token of an assistant
piece (its reasoning, `</think>`, content, the DSML tool-call block and the closing EOS); 0 on BOS
(the format's marker, as the server's prompts begin; add_bos) and on the system, user, developer and
tool pieces, which also hold the format's own prompt tokens (`<｜Assistant｜>` and the generation
prompt `<think>` / `</think>` after it, the `<think>` after tool results). With
sft_train_on_completion_only=false every token weighs 1. Every piece boundary sits next to one of
the format's markers, each a single added token of V3.2's tokenizer, so tokenizing piece by piece
gives the ids of the whole text (the encoder checks the markers are single tokens).

The format is chat_template.chat_format's, the server's: with a jinja template (chat_template_path, or the
chat_template of the tokenizer_config.json next to tokenizer_path, under chat_encoding=auto|jinja) the pieces
are chat_template.render_pieces's instead, the assistant's span of each assistant message being what
the template adds for it after the prompt of the messages before it (with the generation prompt),
tokenized piece by piece (a token spanning a piece boundary in the whole text is split there); no BOS
is added (the template writes it); thinking is the template's business.

A conversation of more than max_target_length + 1 tokens is cut after its last assistant turn that
fits (a prefix of its tokens, ending on that turn's EOS), or dropped when even its first assistant
turn does not fit; both are counted and the pipeline reports the counts once. A bad record is one DataError naming where it is: no messages, an unknown role, an
assistant turn with neither content nor tool calls, no assistant turn at all, or what
render_pieces rejects (a tool result answering no call, bad tools).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import numpy as np

from MaxText.config.types import Config, ConfigError
from MaxText.data import chat_dsv32, chat_template
from MaxText.data.packing import Document
from MaxText.data.records import DataError, Table
from MaxText.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


def _columns(columns: tuple[str, ...]) -> str:
  return f"train_data_columns={list(columns)}"


def _as_messages(value: Any, role: str, field: str, where: str) -> list:
  """[prompt, completion] columns: a string is one message of `role`; a list is messages already."""
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  if isinstance(value, (list, tuple)):
    return list(value)
  raise DataError(f"{where}: '{field}' must be a string or a list of messages, got {type(value).__name__}")


def record_messages(record: Any, columns: tuple[str, ...], where: str) -> list[dict]:
  """The record's messages, checked: a bad record is one DataError naming `where`."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: an SFT record is a JSON object with {_columns(columns)}, got {type(record).__name__}")
  missing = [c for c in columns if record.get(c) is None]
  if missing:
    raise DataError(f"{where}: the record has no '{missing[0]}' ({_columns(columns)}); its fields are {sorted(record)}")
  if len(columns) == 1:
    messages = record[columns[0]]
    if not isinstance(messages, (list, tuple)):
      raise DataError(f"{where}: '{columns[0]}' must be a list of messages, got {type(messages).__name__}")
    messages = list(messages)
  else:
    messages = (_as_messages(record[columns[0]], "user", columns[0], where)
                + _as_messages(record[columns[1]], "assistant", columns[1], where))
  if not messages:
    raise DataError(f"{where}: no messages ('{columns[0]}' is empty)")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise DataError(f"{where}: messages[{i}] must be an object with a role, got {type(m).__name__}")
    if m.get("role") not in ROLES:
      raise DataError(f"{where}: messages[{i}].role={m.get('role')!r} is not one of {', '.join(ROLES)}")
    if m["role"] == "assistant" and m.get("content") in (None, "", []) and not m.get("tool_calls"):
      raise DataError(f"{where}: messages[{i}] is an assistant turn with neither content nor tool_calls")
  if not any(m["role"] == "assistant" for m in messages):
    raise DataError(f"{where}: no assistant message: nothing to learn")
  return messages


@dataclasses.dataclass
class ConversationEncoder:
  """Records -> (ids, mask) documents for the packers (packing.Document); picklable (grain workers)."""

  tokenizer: Tokenizer
  columns: tuple[str, ...]
  completion_only: bool
  add_bos: bool
  max_tokens: int  # max_target_length + 1: a row's inputs and its last target
  cut: int = 0  # conversations over max_tokens cut at a turn boundary, so far
  dropped: int = 0  # conversations over max_tokens whose first assistant turn does not fit, so far
  template: str | None = None  # chat_template_path's jinja source: rendered instead of V3.2's format
  special: dict = dataclasses.field(default_factory=dict)  # {bos_token, eos_token} for the template
  thinking: bool = False  # chat_thinking: the mode of a record with neither "thinking" nor reasoning_content

  @classmethod
  def from_config(cls, config: Config, tokenizer: Tokenizer) -> ConversationEncoder:
    fmt = chat_template.chat_format(config, has_tokenizer=True)  # the format the server renders in
    if fmt.encoding == "jinja":  # the template writes BOS itself (as the server renders it)
      if fmt.template is None:
        raise ConfigError(f"chat_encoding={config.chat_encoding}: SFT renders with a jinja template and there is none "
                          f"({fmt.source}): set chat_template_path, or chat_encoding=deepseek_v32")
      template, special = fmt.template, fmt.special
      chat_template.compile_template(template)  # a template that does not compile: one ConfigError now
      return cls(tokenizer, tuple(config.train_data_columns), config.sft_train_on_completion_only, False,
                 config.max_target_length + 1, template=template, special=special)
    split = {m: tokenizer.encode(m) for m in chat_dsv32.SPECIAL_TOKENS}
    split = {m: ids for m, ids in split.items() if len(ids) != 1}
    if split:
      marker, ids = next(iter(split.items()))
      raise DataError(f"use_sft renders DeepSeek-V3.2's chat format, whose markers must be single tokens: the "
                      f"tokenizer at tokenizer_path='{tokenizer.path}' splits {marker} into {len(ids)} tokens; use "
                      "DeepSeek-V3.2's tokenizer.json (tokenizer_type=hf)")
    return cls(tokenizer, tuple(config.train_data_columns), config.sft_train_on_completion_only, config.add_bos,
               config.max_target_length + 1, thinking=config.chat_thinking)

  def __call__(self, record: Any, where: str) -> tuple[np.ndarray, np.ndarray] | None:
    messages = record_messages(record, self.columns, where)
    thinking = record.get("thinking")
    if thinking is None:
      thinking = any(m.get("reasoning_content") for m in messages if m["role"] == "assistant") or self.thinking
    try:
      if self.template is not None:
        pieces = chat_template.render_pieces(self.template, messages, tools=record.get("tools"), special=self.special)
      else:
        tools = chat_dsv32.check_tools(record.get("tools"))
        pieces = chat_dsv32.render_pieces(messages, thinking=bool(thinking), tools=tools, bos=self.add_bos)
    except (chat_dsv32.ChatFormatError, chat_template.TemplateRenderError) as e:
      raise DataError(f"{where}: {e}") from None
    ids: list[int] = []
    mask: list[float] = []
    turn_ends = []  # token count after each assistant piece
    for role, text in pieces:
      piece = self.tokenizer.encode(text)
      ids += piece
      mask += [1.0 if role == "assistant" or not self.completion_only else 0.0] * len(piece)
      if role == "assistant":
        turn_ends.append(len(ids))
    if len(ids) > self.max_tokens:
      fits = [n for n in turn_ends if n <= self.max_tokens]
      if not fits:
        self.dropped += 1
        return None
      self.cut += 1
      ids, mask = ids[:fits[-1]], mask[:fits[-1]]
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)

  def too_long_note(self) -> str:
    return (f"conversations longer than max_target_length + 1 = {self.max_tokens} tokens: {self.cut} cut after "
            f"their last assistant turn that fits, {self.dropped} dropped (even the first assistant turn is longer); "
            "raise max_target_length to keep them whole")


class ConversationReader:
  """Record i of a records.Table (dataset_type=grain / hf) -> its Document; picklable (grain workers).
  A dropped (too long) conversation is an empty document, which the packer skips; the first cut or
  drop in a process is logged."""

  def __init__(self, table: Table, encoder: ConversationEncoder):
    self.table, self.encoder = table, encoder
    self._told = False

  def record(self, i: int) -> Any:
    value = self.table.raw(i)
    if not self.table.columns:  # ArrayRecord: a UTF-8 JSON object per record
      try:
        return json.loads(value.decode("utf-8"))
      except (UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{self.table.where(i)}: use_sft needs a UTF-8 JSON object per record ({e})") from None
    return {self.table.columns[0]: value} if len(self.table.columns) == 1 else value

  def __call__(self, i: int) -> Document:
    doc = self.encoder(self.record(i), self.table.where(i))
    if self.encoder.cut + self.encoder.dropped == 1 and not self._told:
      self._told = True
      log.warning("%s: %s (the first in this process; later ones are not logged)", self.table.where(i),
                  self.encoder.too_long_note())
    return np.zeros(0, np.int32) if doc is None else doc
