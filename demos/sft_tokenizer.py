"""A small BPE tokenizer for the SFT demo, trained on its own conversations (the `tokenizers` library).

    path = train_tokenizer(texts, "<work>/tokenizer.json", vocab_size=512)

The conversations are rendered in DeepSeek-V3.2's format (chat_dsv32.render, as train.py and the
server render them) and the tokenizer learns their text. Why: with the byte-level test tokenizer
(tests/data/tokenizer.json) the format's tools block makes a tool conversation ~1040 tokens and a
row holds one; learned merges make the fixed texts (the tools block, the DSML call, the thinking
trace's words) a few tokens each, so a tool conversation fits a short row beside other ones.
Invariants: the format's 7 markers are added special tokens (one id each, as in V3.2's
tokenizer); every digit is its own token (no merge spans a digit, so the model reads and copies
numbers digit by digit); byte-level, so any text encodes and decodes losslessly.
"""

from __future__ import annotations

from typing import Iterable

from MaxText.data import chat_dsv32

PAD = "<pad>"


def train_tokenizer(texts: Iterable[str], path: str, vocab_size: int = 512) -> str:
  """Trains on `texts`, writes a tokenizer.json at `path` -> path. vocab_size counts the 256 bytes,
  the markers and <pad> (id 0); it must not exceed the model's vocab_size."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  # Digits first (each its own piece), then bytes; no regex split, so merges span words and spaces.
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, *chat_dsv32.SPECIAL_TOKENS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  return path


def rendered(records: Iterable[dict]) -> Iterable[str]:
  """Each record's conversation as the text train.py tokenizes (thinking on when it has reasoning)."""
  for r in records:
    thinking = any(m.get("reasoning_content") for m in r["messages"] if m["role"] == "assistant")
    yield chat_dsv32.render(r["messages"], thinking=thinking, tools=r.get("tools"))
