"""python -m MaxText.pretokenize: text, jsonl, Parquet and a saved HF dataset -> ArrayRecord shards of token
ids that train as dataset_type=grain with tokenize_train_data=false, the same batches as the text."""

import json
import os

import numpy as np
import pytest

from MaxText import pretokenize
from MaxText.data import input_pipeline as ip
from MaxText.data.tokenizer import load_tokenizer
from tests.conftest import make_config

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SP_MODEL = os.path.join(DATA, "tokenizer.model")


def _inputs(d):
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts, _ = ip.read_documents(os.path.join(DATA, "corpus.txt"), "text")
  parts = [texts[:10], texts[10:20], texts[20:30], texts[30:40]]
  (d / "a.txt").write_text("\n\n".join(parts[0]) + "\n")
  (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in parts[1] + [""]))
  pq.write_table(pa.table({"text": parts[2]}), d / "c.parquet", row_group_size=4)
  datasets.Dataset.from_dict({"text": parts[3]}).save_to_disk(str(d / "hf"))
  return texts[:40]


def test_every_input_kind_becomes_shards_that_train_like_the_text(tmp_path, capsys):
  texts = _inputs(tmp_path)
  out = tmp_path / "shards"
  pretokenize.main(["--input", f"{tmp_path}/a.txt,{tmp_path}/b.jsonl,{tmp_path}/c.parquet,{tmp_path}/hf",
                    "--tokenizer", SP_MODEL, "--output", str(out), "--workers", "2", "--quiet"])
  line = capsys.readouterr().out.strip().splitlines()[-1]
  summary = json.loads((out / "summary.json").read_text())
  tok = load_tokenizer(make_config(tokenizer_path=SP_MODEL))
  ids = [tok.encode(t) for t in texts]
  assert summary["documents"] == 40 and summary["tokens"] == sum(map(len, ids))
  assert summary["empty_documents"] == 1 and summary["shards"] == 1 + 1 + 3 + 1  # c.parquet: 3 row groups
  assert f"40 documents, {summary['tokens']:,} tokens in 6 shard(s)" in line
  # the shards, in order, hold the documents' ids in input order
  from array_record.python.array_record_module import ArrayRecordReader
  shards = sorted(out.glob("*.arrayrecord"))
  got = [np.frombuffer(r, "<i4").tolist() for s in shards for r in ArrayRecordReader(str(s)).read_all()]
  assert got == ids
  # and train as the same batches as the text they came from
  common = dict(tokenizer_path=SP_MODEL, max_target_length=16, max_prefill_length=16, global_batch_size=4,
                grain_worker_count=0, dataset_type="grain")
  from_ids = ip.create_data_iterator(make_config(grain_train_files=str(out), tokenize_train_data=False,
                                                 **common), process_index=0, process_count=1)
  text_shard = tmp_path / "text.arrayrecord"
  from array_record.python.array_record_module import ArrayRecordWriter
  w = ArrayRecordWriter(str(text_shard), "group_size:1")
  for t in texts:
    w.write(t.encode())
  w.close()
  from_text = ip.create_data_iterator(make_config(grain_train_files=str(text_shard), **common),
                                      process_index=0, process_count=1)
  for _ in range(4):
    a, b = next(from_ids), next(from_text)
    for k in ip.BATCH_KEYS:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("args, message", [
    (["--input", "{d}/none-*.txt"], "matches no file"),
    (["--input", "{d}/c.parquet", "--text-column", "body"], "has no column 'body'"),
    (["--input", "{d}/a.txt", "--tokenizer", "{d}/missing.model"], "tokenizer_path="),
    (["--input", "{d}/a.txt", "--output", "{d}"], "already holds 1 .arrayrecord"),
])
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys, args, message):
  _inputs(tmp_path)
  (tmp_path / "old.arrayrecord").write_bytes(b"")
  capsys.readouterr()  # datasets' own progress lines while making the inputs
  argv = ["--tokenizer", SP_MODEL, "--output", str(tmp_path / "out"), "--quiet"] + [a.format(d=tmp_path) for a in args]
  # (a later --tokenizer / --output overrides the first)
  with pytest.raises(SystemExit) as e:
    pretokenize.main(argv)
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_help_lists_the_options(capsys):
  with pytest.raises(SystemExit):
    pretokenize.main(["--help"])
  out = capsys.readouterr().out
  for flag in ("--input", "--tokenizer", "--output", "--tokenizer-type", "--text-column", "--workers", "--quiet"):
    assert flag in out
