"""MaxText/data/input_pipeline.py and MaxText/data/tokenizer.py: batch layout, packing, resume, errors, tokenizers."""

import json
import logging
import os

import numpy as np
import pytest

from MaxText.data import input_pipeline as ip
from MaxText.data.tokenizer import TextStreamer, TokenizerError, load_tokenizer
from tests.conftest import make_config

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CORPUS_TXT = os.path.join(DATA, "corpus.txt")
CORPUS_JSONL = os.path.join(DATA, "corpus.jsonl")
SP_MODEL = os.path.join(DATA, "tokenizer.model")
HF_JSON = os.path.join(DATA, "tokenizer.json")
TOKENIZERS = {"sentencepiece": SP_MODEL, "hf": HF_JSON}
PAD, BOS, EOS = 0, 1, 2


def file_config(**kw):
  kw.setdefault("dataset_path", CORPUS_TXT)
  kw.setdefault("tokenizer_type", "sentencepiece")
  kw.setdefault("tokenizer_path", TOKENIZERS[kw["tokenizer_type"]])
  if kw.get("max_target_length", 64) < 32:
    kw.setdefault("max_prefill_length", kw["max_target_length"])
  return make_config(dataset_type="file", **kw)


def iterator(config, **kw):
  kw.setdefault("process_index", 0)
  kw.setdefault("process_count", 1)
  return ip.create_data_iterator(config, **kw)


def take(it, n):
  return [next(it) for _ in range(n)]


def rows(batches, key):
  """[num_batches * B, L]: the rows of consecutive batches, in stream order."""
  return np.concatenate([b[key] for b in batches])


def epoch_rows(config, **kw):
  """The rows of epoch 0 (and the first row of epoch 1) as a dict of [R + 1, L] arrays."""
  it = iterator(config, **kw)
  R = it.source.corpus.rows_per_epoch
  batches = take(it, R // config.global_batch_size + 1)
  return {k: rows(batches, k)[:R + 1] for k in ip.BATCH_KEYS}, it


def tokenized_docs(config):
  tok = load_tokenizer(config)
  docs, _ = ip.read_documents(config.dataset_path, config.jsonl_text_field)
  return ip.tokenize_documents(docs, tok, add_bos=config.add_bos, add_eos=config.add_eos)


# ------------------------------------------------------------------------------------- layout


def retrieval_config(**kw):
  kw = {"dataset_type": "synthetic_retrieval", "retrieval_pairs": 6, "retrieval_queries": 4, "retrieval_keys": 12,
        "retrieval_values": 5, "vocab_size": 128, **kw}
  return make_config(**kw)


def config_of(dataset_type):
  return {"file": lambda: file_config(max_target_length=16), "synthetic": make_config,
          "synthetic_retrieval": retrieval_config}[dataset_type]()


@pytest.mark.parametrize("dataset_type", ["synthetic", "synthetic_retrieval", "file"])
def test_batch_is_int32_arrays_of_global_batch_by_length_and_float32_weights(dataset_type):
  config = config_of(dataset_type)
  batch = next(iterator(config))
  assert set(batch) == set(ip.BATCH_KEYS)
  for k, v in batch.items():
    assert isinstance(v, np.ndarray)
    assert v.shape == (config.global_batch_size, config.max_target_length), k
    assert v.dtype == (np.float32 if k == "weights" else np.int32), k


@pytest.mark.parametrize("tokenizer_type", ["sentencepiece", "hf"])
def test_targets_are_the_next_token_of_the_stream_within_rows_and_across_row_ends(tokenizer_type):
  config = file_config(tokenizer_type=tokenizer_type, max_target_length=16)
  r, it = epoch_rows(config)
  R = it.source.corpus.rows_per_epoch
  inp, tgt, seg, w = r["inputs"][:R], r["targets"][:R], r["segment_ids"][:R], r["weights"][:R]
  real = seg != 0
  inner = real[:, 1:]
  np.testing.assert_array_equal(tgt[:, :-1][inner], inp[:, 1:][inner])
  np.testing.assert_array_equal(tgt[:-1, -1], inp[1:, 0])  # a row's last target is the next row's first input
  assert np.all(tgt[~real] == PAD)
  # documents longer than a row are split, and the prediction across the cut is kept
  continued = (r["positions"][1:R, 0] == 0) & (inp[1:, 0] != BOS)
  assert continued.sum() > 10
  assert np.all(w[:-1, -1][continued] == 1)


def test_weights_are_zero_exactly_at_padding_and_document_ends():
  # add_eos: a document's last token is EOS, whose next token belongs to the next document
  r, _ = epoch_rows(file_config(max_target_length=16))
  zero = (r["segment_ids"] == 0) | (r["inputs"] == EOS)
  np.testing.assert_array_equal(r["weights"] == 0, zero)
  assert (r["segment_ids"] == 0).any() and (r["inputs"] == EOS).any()
  # no EOS: the last token of a document is the one before the next BOS (or the end of the epoch)
  r, _ = epoch_rows(file_config(max_target_length=16, add_eos=False))
  zero = (r["segment_ids"] == 0) | (r["targets"] == BOS) | (r["targets"] == PAD)
  np.testing.assert_array_equal(r["weights"] == 0, zero)


def test_weights_count_every_next_token_prediction_of_an_epoch():
  config = file_config(max_target_length=16, add_bos=False, add_eos=False)
  r, it = epoch_rows(config)
  R = it.source.corpus.rows_per_epoch
  docs = tokenized_docs(config)
  assert r["weights"][:R].sum() == sum(len(d) - 1 for d in docs)
  seg = r["segment_ids"]
  change = seg[:, 1:] != seg[:, :-1]
  np.testing.assert_array_equal((r["weights"][:, :-1] == 0), (seg[:, :-1] == 0) | change)


@pytest.mark.parametrize("length", [16, 256])
def test_positions_restart_at_zero_for_each_document_in_a_row(length):
  r, _ = epoch_rows(file_config(max_target_length=length))
  seg, pos = r["segment_ids"], r["positions"]
  starts = np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  np.testing.assert_array_equal(pos[starts], 0)
  cont = ~starts & (seg != 0)
  np.testing.assert_array_equal(pos[:, 1:][cont[:, 1:]], pos[:, :-1][cont[:, 1:]] + 1)
  assert np.all(pos[r["inputs"] == BOS] == 0) and np.all(pos[seg == 0] == 0)
  np.testing.assert_array_equal(seg[:, 0], 1)
  assert pos.max() < length and seg.max() >= (2 if length == 16 else 3)


@pytest.mark.parametrize("shuffle", [False, True])
def test_packing_loses_no_tokens_over_an_epoch(shuffle):
  config = file_config(max_target_length=16)
  r, it = epoch_rows(config, shuffle=shuffle)
  R = it.source.corpus.rows_per_epoch
  docs = tokenized_docs(config)
  total = sum(len(d) for d in docs)
  packed = r["inputs"][:R][r["segment_ids"][:R] != 0]
  assert len(packed) == total == it.report.tokens
  assert R == -(-total // 16)
  flat = np.concatenate(docs)
  if shuffle:
    np.testing.assert_array_equal(np.bincount(packed, minlength=512), np.bincount(flat, minlength=512))
    assert not np.array_equal(packed, flat)
  else:
    np.testing.assert_array_equal(packed, flat)
  assert r["inputs"][R, 0] == BOS and r["positions"][R, 0] == 0  # epoch 1 starts with a whole document
  assert (r["segment_ids"][:R - 1] != 0).all()  # only the epoch's last row is padded


def test_epochs_are_shuffled_differently_and_keep_every_document():
  config = file_config(max_target_length=16)
  it = iterator(config)
  R = it.source.corpus.rows_per_epoch
  batches = take(it, 2 * R // config.global_batch_size + 2)
  inp, seg = rows(batches, "inputs"), rows(batches, "segment_ids")
  e0, e1 = inp[:R][seg[:R] != 0], inp[R:2 * R][seg[R:2 * R] != 0]
  assert len(e0) == len(e1) and not np.array_equal(e0, e1)
  np.testing.assert_array_equal(np.sort(e0), np.sort(e1))


# ------------------------------------------------------------------------------------- determinism and resume


@pytest.mark.parametrize("dataset_type", ["synthetic", "synthetic_retrieval", "file"])
def test_same_seed_gives_the_same_batches_and_another_seed_others(dataset_type):
  make = {"file": lambda **kw: file_config(max_target_length=16, **kw), "synthetic": make_config,
          "synthetic_retrieval": retrieval_config}[dataset_type]
  a = take(iterator(make(seed=3)), 12)
  b = take(iterator(make(seed=3), num_threads=0), 12)
  c = take(iterator(make(seed=4)), 12)
  for x, y in zip(a, b):
    for k in ip.BATCH_KEYS:
      np.testing.assert_array_equal(x[k], y[k])
  assert not all(np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))


@pytest.mark.parametrize("dataset_type", ["synthetic", "synthetic_retrieval", "file"])
@pytest.mark.parametrize("n", [0, 5, 13])
def test_set_state_resumes_at_exactly_the_next_batch(dataset_type, n):
  config = config_of(dataset_type)
  run = iterator(config)
  seen = take(run, n + 1)                        # batches 0..n
  state = json.loads(json.dumps(run.get_state()))
  assert state["step"] == n + 1 and state["dataset_type"] == dataset_type
  uninterrupted = next(run)                      # batch n + 1
  fresh = iterator(config)
  next(fresh)                                    # the restored iterator may have moved already
  fresh.set_state(state)
  restored = next(fresh)
  from_start_step = next(iterator(config, start_step=n + 1))
  for k in ip.BATCH_KEYS:
    np.testing.assert_array_equal(restored[k], uninterrupted[k])
    np.testing.assert_array_equal(from_start_step[k], uninterrupted[k])
  assert not np.array_equal(restored["inputs"], seen[-1]["inputs"])
  assert fresh.get_state()["step"] == n + 2
  fresh.close()


def test_set_state_rejects_a_state_of_another_dataset_type():
  synthetic = iterator(make_config()).get_state()
  with pytest.raises(ip.DataError, match="dataset_type"):
    iterator(file_config()).set_state(synthetic)
  for bad in (-1, 1.5, "3", True):
    with pytest.raises(ip.DataError, match="step"):
      iterator(make_config()).set_state({"dataset_type": "synthetic", "step": bad})
  it = iterator(make_config())
  it.set_state({**it.get_state(), "step": np.array(4, np.int64)})  # as a checkpoint may hand it back
  assert it.get_state()["step"] == 4 and isinstance(it.get_state()["step"], int)


def test_resuming_with_another_batch_size_warns_naming_what_changed(caplog):
  state = iterator(make_config()).get_state()
  with caplog.at_level(logging.WARNING, logger="MaxText.input_pipeline"):
    iterator(make_config(global_batch_size=4)).set_state(state)
  assert "global_batch_size" in caplog.text and "(8, 4)" in caplog.text


def test_processes_get_contiguous_slices_of_the_global_batch():
  for config in (make_config(), file_config()):
    whole = next(iterator(config))
    parts = [next(iterator(config, process_index=p, process_count=2)) for p in range(2)]
    for k in ip.BATCH_KEYS:
      assert parts[0][k].shape[0] == config.global_batch_size // 2
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])


# ------------------------------------------------------------------------------------- synthetic task


def test_synthetic_next_token_is_a_function_of_the_two_before_it():
  config = make_config(vocab_size=64)
  content = np.array([i for i in range(64) if i not in (PAD, BOS, EOS)])
  M = len(content)
  index = {int(t): i for i, t in enumerate(content)}
  steps = set()
  for batch in take(iterator(config), 6):
    seq = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)  # [B, L+1]
    assert not np.isin(seq, [PAD, BOS, EOS]).any()
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    v = np.vectorize(index.get)(seq)
    np.testing.assert_array_equal(v[:, 2:], (2 * v[:, 1:-1] - v[:, :-2]) % M)
    steps.update(((v[:, 1] - v[:, 0]) % M).tolist())
    np.testing.assert_array_equal(batch["segment_ids"], 1)
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(64), (8, 64)))
    np.testing.assert_array_equal(batch["weights"], 1)
  assert steps == set(ip.SYNTHETIC_STEPS)  # the step varies: it must be read from context


@pytest.mark.parametrize("pair_tokens", [1, 2])
def test_retrieval_scores_only_queries_whose_answer_is_their_pair_far_back_in_the_context(pair_tokens):
  config = retrieval_config(retrieval_pair_tokens=pair_tokens)
  n, q, nk, nv, L = 6, 4, 12, 5, 64
  content = np.array([i for i in range(128) if i not in (PAD, BOS, EOS)])
  values, keys = content[:nv], content[nv:nv + nk]
  pair_ids = content[nv + nk:nv + nk + nk * nv].reshape(nk, nv) if pair_tokens == 1 else None
  filler = content[nv + nk + (nk * nv if pair_tokens == 1 else 0):]
  answers = set()
  it = iterator(config)
  for batch in take(it, 3):
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(batch["segment_ids"], 1)
    for row in range(config.global_batch_size):
      tok = np.append(batch["inputs"][row], batch["targets"][row, -1])  # the stream [L+1]
      c = L + 1 - 2 * q
      ctx = tok[:c]
      scored = np.flatnonzero(batch["weights"][row])
      np.testing.assert_array_equal(scored, np.arange(c, L, 2))  # exactly the queried keys' positions
      asked = tok[scored]
      assert len(set(asked.tolist())) == q and np.isin(asked, keys).all()
      if pair_tokens == 1:
        placed = ctx[np.isin(ctx, pair_ids)]
        assert len(placed) == n and not np.isin(ctx, keys).any() and not np.isin(ctx, values).any()
        kv = {int(keys[i // nv]): int(values[i % nv]) for i in np.searchsorted(pair_ids.reshape(-1), placed)}
      else:
        at = np.flatnonzero(np.isin(ctx, keys))
        assert len(at) == n and np.isin(ctx[at + 1], values).all()
        assert np.isin(ctx, values).sum() == n  # values only right after their key
        kv = {int(ctx[i]): int(ctx[i + 1]) for i in at}
      pair_tokens_at = np.isin(ctx, pair_ids) if pair_tokens == 1 else np.isin(ctx, keys) | np.isin(ctx, values)
      assert len(kv) == n and np.isin(ctx[~pair_tokens_at], filler).all()  # the rest is filler
      where = it.source.pair_positions(batch["inputs"][row])  # [L]
      np.testing.assert_array_equal(np.flatnonzero(where >= 0), scored)
      for i in scored:
        assert batch["targets"][row, i] == kv[int(tok[i])]  # the answer is the value of that key's pair
        at = where[i]
        assert (kv[int(tok[i])] == tok[at] if pair_tokens == 2 else  # pair_positions points at the pair
                pair_ids[list(keys).index(tok[i]), list(values).index(kv[int(tok[i])])] == tok[at])
        answers.add(int(batch["targets"][row, i]))
  assert answers == set(values.tolist())  # every value id answers some query: 1/nv is chance


def test_retrieval_eval_stream_is_disjoint_from_training_and_bad_sizes_are_named():
  config = retrieval_config()
  train_rows = {tuple(r) for b in take(iterator(config), 20) for r in b["inputs"]}
  eval_it = ip.create_eval_iterator(config, process_index=0, process_count=1)
  eval_rows = {tuple(r) for i in range(20) for r in eval_it.source[i]["inputs"]}
  assert len(train_rows) == 160 and len(eval_rows) == 160 and not train_rows & eval_rows
  with pytest.raises(ip.DataError, match="vocab_size=64.*raise it to > 80"):
    iterator(retrieval_config(vocab_size=64, retrieval_pair_tokens=1))
  from MaxText.config.types import ConfigError
  with pytest.raises(ConfigError, match="retrieval_queries"):
    retrieval_config(retrieval_queries=7)
  with pytest.raises(ConfigError, match="max_target_length=16"):
    retrieval_config(max_target_length=16, max_prefill_length=16)


# ------------------------------------------------------------------------------------- file formats


def test_jsonl_with_a_custom_text_field_reads_the_same_documents_as_the_txt():
  txt = iterator(file_config())
  jsonl = iterator(file_config(dataset_path=CORPUS_JSONL, jsonl_text_field="content"))
  assert jsonl.report.documents == txt.report.documents == 40
  assert jsonl.report.tokens == txt.report.tokens
  for k in ip.BATCH_KEYS:
    np.testing.assert_array_equal(next(jsonl)[k], next(txt)[k])


def test_a_folder_is_read_recursively_and_other_files_are_counted(tmp_path):
  (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\n\n  \nsecond one\n")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "b.jsonl").write_text('{"text": "from jsonl"}\n\n{"text": "  "}\n{"text": "again"}\n')
  (tmp_path / "notes.md").write_text("ignored")
  docs, report = ip.read_documents(str(tmp_path), "text")
  assert docs == ["first paragraph\nstill first", "second one", "from jsonl", "again"]
  assert report.blank_jsonl_lines == 1 and report.empty_documents == 1
  assert [os.path.basename(f) for f in report.ignored_files] == ["notes.md"]
  it = iterator(file_config(dataset_path=str(tmp_path)))
  assert it.report.documents == 4 and "1 file(s) that are not" in it.report.summary()


@pytest.mark.parametrize("content, match", [
    ('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', r"bad\.jsonl:3: not valid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', r"bad\.jsonl:2: the record has no field 'text'.*\['body'\]"),
    ('{"text": 7}\n', r"bad\.jsonl:1: field 'text' \(jsonl_text_field\) holds a int"),
    ('["text"]\n', r"bad\.jsonl:1: a jsonl line must be a JSON object"),
])
def test_bad_jsonl_lines_raise_naming_the_file_line_and_key(tmp_path, content, match):
  path = tmp_path / "bad.jsonl"
  path.write_text(content)
  with pytest.raises(ip.DataError, match=match):
    iterator(file_config(dataset_path=str(path)))


def test_bad_dataset_paths_raise_naming_the_path(tmp_path):
  cases = {"": "dataset_path is empty", str(tmp_path / "nope.txt"): "nope.txt' does not exist"}
  (tmp_path / "blank.txt").write_text("\n  \n\n")
  cases[str(tmp_path / "blank.txt")] = "blank.txt' holds no documents"
  (tmp_path / "latin1.txt").write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
  cases[str(tmp_path / "latin1.txt")] = r"latin1.txt:2: not valid UTF-8"
  (tmp_path / "empty_dir").mkdir()
  cases[str(tmp_path / "empty_dir")] = "empty_dir' is a folder with no .txt or .jsonl files"
  (tmp_path / "data.csv").write_text("a,b\n")
  cases[str(tmp_path / "data.csv")] = "data.csv' is neither a .txt nor a .jsonl"
  for path, match in cases.items():
    with pytest.raises(ip.DataError, match=match):
      iterator(file_config(dataset_path=path))


def test_a_tokenizer_larger_than_vocab_size_is_rejected():
  with pytest.raises(ip.DataError, match=r"has 384 tokens but vocab_size=256"):
    iterator(file_config(vocab_size=256))


# ------------------------------------------------------------------------------------- tokenizers


TEXTS = ["I love to walk along the river.", "  two  spaces,\ttabs\nand a newline", "Café 東京 😀 123", "a"]


@pytest.mark.parametrize("tokenizer_type", ["sentencepiece", "hf"])
def test_tokenizers_round_trip_text_and_name_their_special_ids(tokenizer_type):
  tok = load_tokenizer(make_config(tokenizer_type=tokenizer_type, tokenizer_path=TOKENIZERS[tokenizer_type]))
  trained = 384  # tokenizer.json also holds DeepSeek-V3.2's 7 chat tokens after them (tests/unit/test_chat_dsv32.py)
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (PAD, BOS, EOS, trained + 7 * (tokenizer_type == "hf"))
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids and all(3 <= i < trained for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([BOS] + ids + [EOS, PAD]) == text
  assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
  assert len(tok.encode("I love to walk")) < len("I love to walk")  # it learned merges


@pytest.mark.parametrize("tokenizer_type", ["sentencepiece", "hf"])
def test_text_streamer_emits_the_decoded_text_piece_by_piece(tokenizer_type):
  tok = load_tokenizer(tokenizer_type=tokenizer_type, tokenizer_path=TOKENIZERS[tokenizer_type])
  prompt = tok.encode("I love to")
  for text in TEXTS:
    ids = tok.encode(text)
    streamer = TextStreamer(tok, [BOS] + prompt)
    pieces = [streamer.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "\ufffd" not in "".join(pieces)


def test_hf_tokenizer_reads_special_tokens_from_tokenizer_config_json(tmp_path):
  with open(HF_JSON) as f:
    spec = json.load(f)
  (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "</s>"}, "eos_token": "<s>", "pad_token": None}))
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=str(tmp_path), pad_id=0)  # a folder works too
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (EOS, BOS, PAD)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
  with pytest.raises(TokenizerError, match="bos_token='<nope>'"):
    load_tokenizer(tokenizer_type="hf", tokenizer_path=str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("tokenizer_type", ["sentencepiece", "hf"])
def test_missing_or_unreadable_tokenizer_paths_raise_naming_tokenizer_path(tmp_path, tokenizer_type):
  garbage = tmp_path / "garbage.bin"
  garbage.write_bytes(b"\x00not a tokenizer\xff" * 10)
  cases = {"": "tokenizer_path is empty", str(tmp_path / "missing.model"): "missing.model' does not exist",
           str(garbage): "garbage.bin' is not a readable", str(tmp_path): "is a folder without"}
  for path, match in cases.items():
    with pytest.raises(TokenizerError, match=match) as e:
      load_tokenizer(make_config(tokenizer_type=tokenizer_type, tokenizer_path=path))
    assert "tokenizer_path" in str(e.value) and path in str(e.value)
  with pytest.raises(TokenizerError, match="tokenizer_path"):
    iterator(file_config(tokenizer_type=tokenizer_type, tokenizer_path=str(tmp_path / "missing")))
