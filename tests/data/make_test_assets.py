"""Regenerates the small test assets of tests/data from the shipped corpus.txt, offline.

    python tests/data/make_test_assets.py

Writes, next to this file:
  corpus.jsonl       the paragraphs of corpus.txt as {"id": i, "content": text} records
                     (the field is not "text" on purpose: tests set jsonl_text_field=content)
  tokenizer.model    a sentencepiece BPE model (vocab 384, byte fallback, identity
                     normalization: decode(encode(s)) == s for any text)
  tokenizer.json     a Hugging Face `tokenizers` byte-level BPE (vocab 384), then DeepSeek-V3.2's chat
                     tokens as added special tokens (ids 384-390, MaxText/data/chat_dsv32.py): the tiny
                     model serves the real conversation format end to end

Both tokenizers use the ids of configs/base.yml: pad 0, bos 1, eos 2 (unk 3), and a vocabulary
smaller than the tiny model's vocab_size (512). Runs are deterministic: the same corpus gives
byte-identical files (training is single-threaded and paths are relative).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 384
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
# DeepSeek-V3.2's conversation tokens (BOS, EOS, turns, thinking, DSML's marker), added after the
# trained vocabulary so the ids above never move. Spelled here, not imported: this script runs alone.
CHAT_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                 "</think>", "｜DSML｜"]  # ids 384-390


def read_paragraphs(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    blocks = f.read().split("\n\n")
  return [b.strip("\n") for b in blocks if b.strip()]


def write_jsonl(paragraphs: list[str], path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for i, p in enumerate(paragraphs):
      f.write(json.dumps({"id": i, "content": p}, ensure_ascii=False) + "\n")


def train_sentencepiece(corpus: str, prefix: str) -> None:
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(
      input=corpus, model_prefix=prefix, model_type="bpe", vocab_size=VOCAB_SIZE,
      pad_id=0, bos_id=1, eos_id=2, unk_id=3,
      pad_piece=SPECIALS[0], bos_piece=SPECIALS[1], eos_piece=SPECIALS[2], unk_piece=SPECIALS[3],
      byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
      remove_extra_whitespaces=False, split_digits=True, num_threads=1, minloglevel=2,
  )
  os.remove(prefix + ".vocab")


def train_hf_bpe(paragraphs: list[str], path: str) -> None:
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
  tok.train_from_iterator(paragraphs, trainer=trainer)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
  tok.save(path, pretty=False)


def main() -> int:
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  os.chdir(HERE)  # sentencepiece stores the input path in the model: keep it relative
  paragraphs = read_paragraphs("corpus.txt")
  write_jsonl(paragraphs, "corpus.jsonl")
  train_sentencepiece("corpus.txt", "tokenizer")
  train_hf_bpe(paragraphs, "tokenizer.json")
  for name in ("corpus.txt", "corpus.jsonl", "tokenizer.model", "tokenizer.json"):
    print(f"{name:16s} {os.path.getsize(name):8d} bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
