"""MaxText/data/records.py, packing.py, streams.py: ArrayRecord, Parquet and HF datasets made here, packed
in lanes; the same batches from every source, any worker or process count; exact resume; bad data named."""

import json
import os

import numpy as np
import pytest

from MaxText.data import input_pipeline as ip
from MaxText.data.packing import pack_row
from MaxText.data.records import DataError
from MaxText.data.tokenizer import load_tokenizer
from tests.conftest import make_config

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SP_MODEL = os.path.join(DATA, "tokenizer.model")
VOCAB = 512


def write_arrayrecord(path, records):
  from array_record.python.array_record_module import ArrayRecordWriter
  w = ArrayRecordWriter(path, "group_size:1")
  for r in records:
    w.write(r)
  w.close()


def write_parquet(path, column, values, row_group_size=7):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({column: values, "id": list(range(len(values)))}), path, row_group_size=row_group_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same 40 documents as text and as token ids, in every format (made once per module)."""
  import datasets
  d = tmp_path_factory.mktemp("streams")
  texts, _ = ip.read_documents(os.path.join(DATA, "corpus.txt"), "text")
  texts = texts[:40]
  tok = load_tokenizer(make_config(tokenizer_path=SP_MODEL))
  ids = [tok.encode(t) for t in texts]
  write_arrayrecord(str(d / "ids-0.arrayrecord"), [np.asarray(x, "<i4").tobytes() for x in ids[:25]])
  write_arrayrecord(str(d / "ids-1.arrayrecord"), [np.asarray(x, "<i4").tobytes() for x in ids[25:]])
  write_arrayrecord(str(d / "text.arrayrecord"), [t.encode() for t in texts])
  write_parquet(str(d / "ids.parquet"), "tokens", ids, row_group_size=64)  # one row group: the flat order
  write_parquet(str(d / "text.parquet"), "text", texts, row_group_size=64)
  datasets.Dataset.from_dict({"tokens": ids, "text": texts}).save_to_disk(str(d / "hf"))
  with open(d / "text.jsonl", "w") as f:
    f.writelines(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts))
  return d


SOURCES = {  # name -> config keys (beside the corpus folder)
    "arrayrecord_ids": dict(dataset_type="grain", grain_train_files="{d}/ids-*.arrayrecord", tokenize_train_data=False),
    "arrayrecord_text": dict(dataset_type="grain", grain_train_files="{d}/text.arrayrecord"),
    "parquet_ids": dict(dataset_type="grain", grain_file_type="parquet", grain_train_files="{d}/ids.parquet",
                        train_data_columns=["tokens"], tokenize_train_data=False),
    "parquet_text": dict(dataset_type="grain", grain_file_type="parquet", grain_train_files="{d}/text.parquet"),
    "hf_disk_ids": dict(dataset_type="hf", hf_path="{d}/hf", train_data_columns=["tokens"], tokenize_train_data=False),
    "hf_disk_text": dict(dataset_type="hf", hf_path="{d}/hf"),
    "hf_jsonl_text": dict(dataset_type="hf", hf_path="{d}/*.jsonl"),
}


def stream_config(corpus, source, **kw):
  keys = {k: v.format(d=corpus) if isinstance(v, str) else v for k, v in SOURCES[source].items()}
  kw.setdefault("max_target_length", 16)
  kw.setdefault("max_prefill_length", kw["max_target_length"])
  kw.setdefault("global_batch_size", 4)
  kw.setdefault("grain_worker_count", 0)
  return make_config(tokenizer_path=SP_MODEL, vocab_size=VOCAB, **{**keys, **kw})


def take(config, n, **kw):
  kw.setdefault("process_index", 0)
  kw.setdefault("process_count", 1)
  it = ip.create_data_iterator(config, **kw)
  out = [next(it) for _ in range(n)]
  return out, it


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in ip.BATCH_KEYS:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_every_source_gives_the_same_batches_from_the_same_documents(corpus):
  """Text tokenized here and ids tokenized before, ArrayRecord (two shards), Parquet and HF: one stream."""
  ref, it = take(stream_config(corpus, "parquet_ids"), 6)
  assert ref[0]["inputs"].shape == (4, 16) and ref[0]["inputs"].dtype == np.int32
  assert ref[0]["weights"].dtype == np.float32
  for source in SOURCES:
    if source != "parquet_ids":
      assert_same(take(stream_config(corpus, source), 6)[0], ref)


def test_lane_rows_follow_the_packing_rules_and_lose_no_token():
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 100, n).astype(np.int32) for n in rng.integers(1, 30, 64)]
  B, L = 3, 8
  for lane in range(B):
    cursor, stream, rows = (lane, 0), [], []
    for _ in range(12):
      row, cursor = pack_row(lambda j: docs[j % len(docs)], cursor, B, L)
      rows.append(row)
    stream = np.concatenate([docs[j % len(docs)] for j in range(lane, lane + 40 * B, B)])
    ins = np.concatenate([r["inputs"] for r in rows])
    np.testing.assert_array_equal(ins, stream[:len(ins)])  # every token, in order, none dropped
    np.testing.assert_array_equal(np.concatenate([r["targets"] for r in rows]), stream[1:len(ins) + 1])
    # document ids of the stream -> the expected segments, positions and weights
    doc_of = np.concatenate([np.full(len(docs[j % len(docs)]), j) for j in range(lane, lane + 40 * B, B)])
    for r, row in enumerate(rows):
      d = doc_of[r * L:r * L + L + 1]
      seg = np.concatenate([[1], 1 + np.cumsum(d[1:L] != d[:L - 1])])
      np.testing.assert_array_equal(row["segment_ids"], seg)
      np.testing.assert_array_equal(row["weights"], (d[1:] == d[:L]).astype(np.float32))
      first = np.searchsorted(d[:L], d[:L], side="left")
      np.testing.assert_array_equal(row["positions"], np.arange(L) - first)


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_batches_and_resume_do_not_depend_on_workers_or_processes(corpus):
  """2 worker processes = 0 workers; two processes' rows = the global batch; a state saved at step 3 by
  one process with no workers resumes exactly on another layout (2 processes, 2 workers)."""
  config = stream_config(corpus, "arrayrecord_text")
  ref, it = take(config, 8)
  it.close()
  first, it = take(config, 3)
  state = json.loads(json.dumps(it.get_state()))
  assert state["step"] == 3 and state["dataset_type"] == "grain" and len(state["cursors"]) == 4
  parts = []
  for p, workers in enumerate((2, 1)):
    it = ip.create_data_iterator(make_config(**{**config.model_dump(), "grain_worker_count": workers}),
                                 process_index=p, process_count=2)
    it.set_state(state)
    parts.append([next(it) for _ in range(5)])
    it.close()
  for k in ip.BATCH_KEYS:
    for s in range(5):
      np.testing.assert_array_equal(np.concatenate([parts[0][s][k], parts[1][s][k]]), ref[3 + s][k])
  assert_same(first, ref[:3])


def test_epochs_read_every_record_once_in_a_new_order(corpus):
  config = stream_config(corpus, "parquet_ids", global_batch_size=1)
  it = ip.create_data_iterator(config, process_index=0, process_count=1)
  e0, e1 = [it.read.record(j) for j in range(40)], [it.read.record(j) for j in range(40, 80)]
  assert sorted(e0) == sorted(e1) == list(range(40)) and e0 != e1
  other = ip.create_data_iterator(stream_config(corpus, "parquet_ids", global_batch_size=1, seed=1),
                                  process_index=0, process_count=1)
  assert [other.read.record(j) for j in range(40)] != e0


def test_parquet_row_groups_are_shuffled_as_blocks_so_lanes_share_the_groups_in_use(tmp_path):
  """Row groups of 10: each epoch visits every row once, a row group at a time (in a new order of
  groups and of rows within each), so B lanes reading neighbouring positions decode few groups."""
  write_parquet(str(tmp_path / "a.parquet"), "tokens", [[5, i + 3] for i in range(30)], row_group_size=10)
  write_parquet(str(tmp_path / "b.parquet"), "tokens", [[6, i + 3] for i in range(25)], row_group_size=10)
  config = make_config(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{tmp_path}/*.parquet",
                       train_data_columns=["tokens"], tokenize_train_data=False, grain_worker_count=0,
                       global_batch_size=4, max_target_length=8, max_prefill_length=8)
  it = ip.create_data_iterator(config, process_index=0, process_count=1)
  assert list(it.read.blocks) == [0, 10, 20, 30, 40, 50, 55]
  epochs = [[it.read.record(j) for j in range(e * 55, (e + 1) * 55)] for e in range(2)]
  for order in epochs:
    assert sorted(order) == list(range(55))
    groups = [int(np.searchsorted(it.read.blocks, r, side="right") - 1) for r in order]
    assert sum(a != b for a, b in zip(groups, groups[1:])) == 5  # one group after another
    assert order != sorted(order)
  assert epochs[0] != epochs[1]


def test_lanes_decode_each_parquet_row_group_about_once_per_epoch(tmp_path, monkeypatch):
  """20 row groups of 5 rows, 4 lanes, 2 epochs: a flat shuffle would decode a group for most rows
  (4 of 20 cached); the block order decodes each group about once per epoch."""
  import pyarrow.parquet as pq
  write_parquet(str(tmp_path / "a.parquet"), "tokens", [[5, i + 3] for i in range(100)], row_group_size=5)
  config = make_config(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{tmp_path}/a.parquet",
                       train_data_columns=["tokens"], tokenize_train_data=False, grain_worker_count=0,
                       global_batch_size=4, max_target_length=15, max_prefill_length=15)
  decodes = []
  orig = pq.ParquetFile.read_row_group
  monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: decodes.append(g) or orig(self, g, **kw))
  it = ip.create_data_iterator(config, process_index=0, process_count=1)
  for _ in range(50):  # 4 lanes x 50 rows x 16 tokens = 3200 tokens: 800 documents of 4, 8 epochs
    next(it)
  assert len(decodes) <= 2 * 20 * 8, len(decodes)


@pytest.mark.parametrize("source", SOURCES)
def test_set_state_resumes_every_source_at_exactly_the_next_batch(corpus, source):
  config = stream_config(corpus, source)
  ref, _ = take(config, 7)
  _, it = take(config, 4)
  state = json.loads(json.dumps(it.get_state()))
  fresh = ip.create_data_iterator(config, process_index=0, process_count=1)
  next(fresh)  # the restored iterator may have moved already
  fresh.set_state(state)
  assert_same([next(fresh) for _ in range(3)], ref[4:])
  assert fresh.get_state()["step"] == 7


def test_eval_batches_are_the_held_out_files_and_a_missing_key_is_named(corpus, tmp_path):
  from MaxText.config.types import ConfigError
  write_arrayrecord(str(tmp_path / "eval.arrayrecord"), [np.arange(400, 410, dtype="<i4").tobytes()] * 3)
  config = stream_config(corpus, "arrayrecord_ids", eval_interval=5, eval_steps=3,
                         grain_eval_files=f"{tmp_path}/eval.arrayrecord")
  held_out = ip.create_eval_iterator(config, process_index=0, process_count=1)
  assert len(held_out.source) == 3 and held_out.source[2]["inputs"].shape == (4, 16)
  ids = np.concatenate([b["inputs"].ravel() for b in held_out.source])
  assert set(ids.tolist()) <= set(range(400, 410)) | {config.bos_id, config.eos_id}
  with pytest.raises(ConfigError, match="needs grain_eval_files"):
    stream_config(corpus, "arrayrecord_ids", eval_interval=5)
  with pytest.raises(ConfigError, match="needs hf_eval_files"):
    stream_config(corpus, "hf_disk_text", eval_interval=5)


def test_a_state_of_another_batching_is_refused(corpus):
  _, it = take(stream_config(corpus, "parquet_ids"), 2)
  state = it.get_state()
  _, other = take(stream_config(corpus, "parquet_ids", global_batch_size=8), 0)
  with pytest.raises(DataError, match="global_batch_size"):
    other.set_state(state)
  with pytest.raises(DataError, match="dataset_type"):
    other.set_state({**state, "dataset_type": "hf"})


# ------------------------------------------------------------------------------------- bad data


def _bad(corpus, tmp_path, case):
  """(config overrides, expected message) for one kind of bad data."""
  ids = [np.arange(3, 20, dtype="<i4").tobytes()] * 5
  if case == "no_match":
    return dict(dataset_type="grain", grain_train_files=f"{tmp_path}/none-*.arrayrecord"), "matches no file"
  if case == "a_summary_beside_the_shards":  # as pretokenize --output leaves them
    write_arrayrecord(str(tmp_path / "shard-0.arrayrecord"), ids)
    (tmp_path / "summary.json").write_text("{}")
    return (dict(dataset_type="grain", grain_train_files=f"{tmp_path}/*"),
            rf"matches {tmp_path}/summary.json, which is not a shard .*grain_train_files='{tmp_path}/\*.arrayrecord'")
  if case == "empty_file":
    open(tmp_path / "empty.arrayrecord", "wb").close()
    return dict(dataset_type="grain", grain_train_files=f"{tmp_path}/empty.arrayrecord"), "empty.arrayrecord: .*empty"
  if case == "truncated":
    write_arrayrecord(str(tmp_path / "cut.arrayrecord"), ids)
    data = open(tmp_path / "cut.arrayrecord", "rb").read()
    open(tmp_path / "cut.arrayrecord", "wb").write(data[:len(data) - 100])
    return dict(dataset_type="grain", grain_train_files=f"{tmp_path}/cut.arrayrecord"), "cut.arrayrecord: .*truncated"
  if case == "no_records":
    write_arrayrecord(str(tmp_path / "none.arrayrecord"), [])
    return dict(dataset_type="grain", grain_train_files=f"{tmp_path}/none.arrayrecord"), "none.arrayrecord: .*no records"
  if case == "corrupt_record":
    write_arrayrecord(str(tmp_path / "bad.arrayrecord"), [np.arange(3, 200, dtype="<i4").tobytes()] * 5)
    data = bytearray(open(tmp_path / "bad.arrayrecord", "rb").read())
    data[300] ^= 0xFF
    open(tmp_path / "bad.arrayrecord", "wb").write(data)
    return (dict(dataset_type="grain", grain_train_files=f"{tmp_path}/bad.arrayrecord", tokenize_train_data=False),
            r"bad.arrayrecord record \d: corrupt record")
  if case == "odd_bytes":
    write_arrayrecord(str(tmp_path / "odd.arrayrecord"), [b"abcde"] * 3)
    return (dict(dataset_type="grain", grain_train_files=f"{tmp_path}/odd.arrayrecord", tokenize_train_data=False),
            r"odd.arrayrecord record \d: corrupt record \(5 bytes")
  if case == "missing_column":
    return (dict(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{corpus}/text.parquet",
                 train_data_columns=["content"]), r"text.parquet has no column 'content'.*\['text', 'id'\]")
  if case == "hf_missing_column":
    return dict(dataset_type="hf", hf_path=f"{corpus}/hf", train_data_columns=["content"]), "no column 'content'"
  if case == "ids_past_vocab":
    write_parquet(str(tmp_path / "big.parquet"), "tokens", [[5, 6], [7, VOCAB + 3, 8]], row_group_size=1)
    return (dict(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{tmp_path}/big.parquet",
                 train_data_columns=["tokens"], tokenize_train_data=False),
            rf"big.parquet record 1: token id {VOCAB + 3} at position 1 is outside the vocabulary")
  if case == "ids_past_vocab_in_a_worker":
    keys, match = _bad(corpus, tmp_path, "ids_past_vocab")
    return dict(keys, grain_worker_count=1), match
  if case == "truncated_parquet":
    data = open(f"{corpus}/ids.parquet", "rb").read()
    open(tmp_path / "cut.parquet", "wb").write(data[:len(data) // 2])
    return (dict(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{tmp_path}/cut.parquet",
                 train_data_columns=["tokens"]), "cut.parquet: not a readable Parquet file")
  if case == "not_a_saved_dataset":
    return dict(dataset_type="hf", hf_path=str(tmp_path)), "is not a dataset folder written by save_to_disk"
  if case == "text_as_ids":
    return (dict(dataset_type="grain", grain_file_type="parquet", grain_train_files=f"{corpus}/text.parquet",
                 tokenize_train_data=False), r"column 'text' .* holds str, not a list of token ids")
  raise AssertionError(case)


BAD = ["no_match", "a_summary_beside_the_shards", "empty_file", "truncated", "no_records", "corrupt_record", "odd_bytes", "missing_column",
       "hf_missing_column", "ids_past_vocab", "ids_past_vocab_in_a_worker", "text_as_ids",
       "truncated_parquet", "not_a_saved_dataset"]


def test_a_folder_of_shards_means_its_shards(corpus):
  from MaxText.data.records import open_table
  (corpus / "summary.json").write_text("{}")  # as pretokenize --output leaves it beside the shards
  try:
    files = open_table(make_config(dataset_type="grain", grain_train_files=str(corpus))).files
  finally:
    (corpus / "summary.json").unlink()
  assert files == [str(corpus / n) for n in ("ids-0.arrayrecord", "ids-1.arrayrecord", "text.arrayrecord")]


@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_one_data_error_naming_the_file_record_or_column(corpus, tmp_path, case):
  keys, match = _bad(corpus, tmp_path, case)
  config = make_config(tokenizer_path=SP_MODEL, vocab_size=VOCAB, global_batch_size=2, max_target_length=16,
                       max_prefill_length=16, **{"grain_worker_count": 0, **keys})
  with pytest.raises(DataError, match=match) as e:
    take(config, 30)
  assert "\n" not in str(e.value)
