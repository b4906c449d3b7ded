"""Tokenizers from local files only: sentencepiece (.model) or Hugging Face `tokenizers` (tokenizer.json).

    tok = load_tokenizer(config)                      # reads tokenizer_type, tokenizer_path, *_id
    ids = tok.encode("I love to")                     # no BOS/EOS: the caller adds them
    text = tok.decode(ids)                            # bos/eos/pad are dropped; other added tokens are text

Nothing is ever downloaded: `tokenizer_path` is a file (or a folder holding tokenizer.model /
tokenizer.json). Special ids come from the tokenizer when it defines them, else from the
config's `bos_id`, `eos_id`, `pad_id`. For a tokenizer.json the BOS/EOS/PAD tokens are read from
a sibling tokenizer_config.json when there is one, else looked up by their usual names.

`TextStreamer` turns a stream of generated ids into text pieces for printing as they come.
"""

from __future__ import annotations

import abc
import functools
import json
import logging
import os
import re
from typing import Any, Sequence

from MaxText.config.types import ConfigError

log = logging.getLogger(__name__)

# Usual spellings, tried in order, for tokenizer.json files without a tokenizer_config.json.
_HF_SPECIAL_NAMES = {
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "[CLS]", "<|startoftext|>"),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "[SEP]", "<|endoftext|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<｜▁pad▁｜>"),
}
_DEFAULT_FILE = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json"}


class TokenizerError(ConfigError):
  """The tokenizer file is missing or unreadable: the message names tokenizer_path and the path."""


class Tokenizer(abc.ABC):
  """encode / decode plus the special ids; `vocab_size` counts every id the tokenizer can emit."""

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int
  path: str

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without BOS/EOS."""

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; special tokens (BOS, EOS, PAD) produce no text."""

  @abc.abstractmethod
  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one token stands for, even when they are not whole UTF-8 characters (a byte-level
    token decodes alone to U+FFFD; its bytes are its own). A special token's bytes are its text."""

  @abc.abstractmethod
  def token_str(self, token_id: int) -> str:
    """One token's vocabulary entry as the tokenizer spells it (BOS as "<s>", not dropped)."""

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})")


class SentencePieceTokenizer(Tokenizer):

  def __init__(self, path: str, *, fallback_ids: dict[str, int | None]):
    import sentencepiece as spm
    self.path = path
    try:
      self._sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # sentencepiece raises OSError / RuntimeError on a bad file
      raise TokenizerError(f"tokenizer_path='{path}' is not a readable sentencepiece model "
                           f"(tokenizer_type=sentencepiece): {e}") from None
    self.vocab_size = int(self._sp.vocab_size())
    own = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id()}
    ids = _resolve_special_ids({k: (v if v >= 0 else None) for k, v in own.items()}, fallback_ids, path)
    self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts), out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def token_bytes(self, token_id: int) -> bytes:
    piece = self._sp.id_to_piece(int(token_id))
    return _byte_fallback(piece) if self._sp.is_byte(int(token_id)) else piece.replace("\u2581", " ").encode()

  def token_str(self, token_id: int) -> str:
    return self._sp.id_to_piece(int(token_id))


class HFTokenizer(Tokenizer):

  def __init__(self, path: str, *, fallback_ids: dict[str, int | None]):
    from tokenizers import Tokenizer as _HF
    self.path = path
    try:
      self._tok = _HF.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
      raise TokenizerError(f"tokenizer_path='{path}' is not a readable Hugging Face tokenizer.json "
                           f"(tokenizer_type=hf): {e}") from None
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    ids = _resolve_special_ids(self._own_special_ids(), fallback_ids, path)
    self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

  def _own_special_ids(self) -> dict[str, int | None]:
    named: dict[str, Any] = {}
    cfg_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
    if os.path.isfile(cfg_path):
      try:
        with open(cfg_path, encoding="utf-8") as f:
          cfg = json.load(f)
      except (OSError, ValueError) as e:
        raise TokenizerError(f"{cfg_path} (next to tokenizer_path='{self.path}') is not valid JSON: {e}") from None
      for kind in ("bos", "eos", "pad"):
        tok = cfg.get(f"{kind}_token")
        named[kind] = tok.get("content") if isinstance(tok, dict) else tok
    out: dict[str, int | None] = {}
    for kind, names in _HF_SPECIAL_NAMES.items():
      if named.get(kind) is not None:
        out[kind] = self._tok.token_to_id(named[kind])
        if out[kind] is None:
          raise TokenizerError(f"{cfg_path} names {kind}_token={named[kind]!r}, which is not in the vocabulary "
                               f"of tokenizer_path='{self.path}'")
        continue
      out[kind] = next((i for i in map(self._tok.token_to_id, names) if i is not None), None)
    return out

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    # Only BOS/EOS/PAD are dropped: other added tokens (a chat format's <think>, </think>, turn and
    # tool-call markers) are text the chat parser reads (MaxText/data/chat_dsv32.py).
    drop = (self.bos_id, self.eos_id, self.pad_id)
    return self._tok.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

  def token_bytes(self, token_id: int) -> bytes:
    from tokenizers import decoders
    piece = self._tok.id_to_token(int(token_id)) or ""
    if int(token_id) in self._added:
      return piece.encode()
    if isinstance(self._tok.decoder, decoders.ByteLevel):  # GPT-2's printable stand-in per byte
      return bytes(_BYTE_OF_CHAR[c] for c in piece)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # sentencepiece's byte fallback, as a tokenizer.json
      return _byte_fallback(piece)
    return self._tok.decode([int(token_id)], skip_special_tokens=False).encode()

  def token_str(self, token_id: int) -> str:
    return self._tok.id_to_token(int(token_id)) or ""

  @functools.cached_property
  def _added(self) -> set[int]:
    return set(self._tok.get_added_tokens_decoder())


def _gpt2_bytes() -> dict[str, int]:
  """GPT-2's byte-level alphabet inverted: each of the 256 stand-in characters -> its byte."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
               *range(ord("\u00ae"), ord("\u00ff") + 1)]
  rest = [b for b in range(256) if b not in printable]
  return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(rest)}


_BYTE_OF_CHAR = _gpt2_bytes()


def _byte_fallback(piece: str) -> bytes:
  """"<0xE2>" -> b"\\xe2" (sentencepiece's byte tokens)."""
  return bytes([int(piece[3:5], 16)])


def _resolve_special_ids(own: dict[str, int | None], fallback: dict[str, int | None], path: str) -> dict[str, int]:
  out = {}
  for kind in ("bos", "eos", "pad"):
    if own.get(kind) is not None:
      out[kind] = int(own[kind])
    elif fallback.get(kind) is not None:
      out[kind] = int(fallback[kind])
      log.info("tokenizer %s defines no %s token; using %s_id=%d from the config", path, kind, kind, out[kind])
    else:
      raise TokenizerError(f"tokenizer_path='{path}' defines no {kind} token and no {kind}_id was given")
  return out


def _resolve_path(tokenizer_type: str, path: str) -> str:
  if not path:
    raise TokenizerError(f"tokenizer_path is empty: tokenizer_type={tokenizer_type} needs a local "
                         f"{_DEFAULT_FILE[tokenizer_type]} file (set tokenizer_path=...; nothing is downloaded)")
  if os.path.isdir(path):
    inner = os.path.join(path, _DEFAULT_FILE[tokenizer_type])
    if not os.path.isfile(inner):
      raise TokenizerError(f"tokenizer_path='{path}' is a folder without {_DEFAULT_FILE[tokenizer_type]} "
                           f"(tokenizer_type={tokenizer_type})")
    return inner
  if not os.path.exists(path):
    raise TokenizerError(f"tokenizer_path='{path}' does not exist (tokenizer_type={tokenizer_type})")
  if not os.access(path, os.R_OK):
    raise TokenizerError(f"tokenizer_path='{path}' is not readable (permissions)")
  return path


def load_tokenizer(config: Any = None, *, tokenizer_type: str | None = None, tokenizer_path: str | None = None,
                   bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None) -> Tokenizer:
  """The tokenizer named by a Config (or anything with its keys); keyword arguments override it.

  bos_id / eos_id / pad_id are fallbacks, used only when the tokenizer defines no such token.
  """
  def pick(name, value):
    if value is not None:
      return value
    return getattr(config, name) if config is not None else None

  tokenizer_type = pick("tokenizer_type", tokenizer_type)
  tokenizer_path = pick("tokenizer_path", tokenizer_path)
  if tokenizer_type not in _DEFAULT_FILE:
    raise TokenizerError(f"tokenizer_type={tokenizer_type!r} is not one of {sorted(_DEFAULT_FILE)}")
  path = _resolve_path(tokenizer_type, str(tokenizer_path or ""))
  fallback = {"bos": pick("bos_id", bos_id), "eos": pick("eos_id", eos_id), "pad": pick("pad_id", pad_id)}
  cls = SentencePieceTokenizer if tokenizer_type == "sentencepiece" else HFTokenizer
  return cls(path, fallback_ids=fallback)


class TextStreamer:
  """Incremental detokenization: `push(id)` returns the new text that id completes ("" while a
  multi-byte character or a merge is still open). Decodes a short window, not the whole prefix,
  and diffs two decodes of the same window so tokenizers that strip a leading space stay right.
  """

  def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
    self._tok = tokenizer
    self._ids = [int(i) for i in prompt_ids]
    self._prefix = max(0, len(self._ids) - 4)  # window start: a few tokens of context for the diff
    self._read = len(self._ids)                # ids up to here are already turned into text

  def push(self, token_id: int) -> str:
    self._ids.append(int(token_id))
    before = self._tok.decode(self._ids[self._prefix:self._read])
    now = self._tok.decode(self._ids[self._prefix:])
    if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
      return ""  # an incomplete UTF-8 sequence (or a merge that rewrote the window): wait for more ids
    self._prefix, self._read = self._read, len(self._ids)
    return now[len(before):]

  def flush(self) -> str:
    """The text of the ids push held back (at the end of a sequence: an incomplete character
    decodes as U+FFFD, as a full decode would show it)."""
    before = self._tok.decode(self._ids[self._prefix:self._read])
    now = self._tok.decode(self._ids[self._prefix:])
    self._prefix = self._read = len(self._ids)
    return now[len(before):] if now.startswith(before) else ""
