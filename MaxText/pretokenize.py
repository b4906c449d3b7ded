"""Text -> ArrayRecord shards of token ids, for dataset_type=grain with tokenize_train_data=false.

    python -m MaxText.pretokenize --input 'corpus/*.jsonl' --tokenizer tokenizer.model --output shards/
    python MaxText/train.py configs/base.yml dataset_type=grain grain_train_files=shards \\
        tokenize_train_data=false tokenizer_path=tokenizer.model

Inputs (comma-separated files, globs or folders): .txt (a document per paragraph), .jsonl (the
--text-column field of each line), .parquet (the --text-column column), and local Hugging Face
datasets (a folder written by save_to_disk). Each record written is one document's token ids as
little-endian int32, without BOS/EOS (training adds them per add_bos / add_eos). Empty documents
are counted and skipped. Work is split into pieces (a .txt/.jsonl file, a Parquet row group, a
range of dataset rows), tokenized by --workers processes; piece i becomes shard i
(shard-00000-of-00012.arrayrecord, in input order). A progress bar counts pieces; the summary
(documents, tokens, shards, time) ends the run and is written to <output>/summary.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from MaxText.data.documents import read_documents
from MaxText.data.records import DataError
from MaxText.data.tokenizer import load_tokenizer
from MaxText.runtime import cli

HF_ROWS_PER_PIECE = 50_000


def list_pieces(inputs: str, column: str) -> list[tuple]:
  """The units of work, in input order: ("file", path) | ("parquet", path, row group) | ("hf", folder, lo, hi)."""
  pieces = []
  for spec in [s.strip() for s in inputs.split(",") if s.strip()]:
    paths = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
    if not paths:
      raise DataError(f"--input '{spec}' matches no file or folder")
    for path in paths:
      if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")) or \
          os.path.isfile(os.path.join(path, "dataset_dict.json")):
        pieces.extend(_hf_pieces(path, column))
      elif os.path.isdir(path):
        found = sorted(os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns
                       if n.endswith((".txt", ".jsonl", ".parquet")) and not n.startswith("."))
        if not found:
          raise DataError(f"--input folder '{path}' holds no .txt, .jsonl or .parquet file (nor a saved dataset)")
        pieces.extend(p for f in found for p in _file_pieces(f, column))
      else:
        pieces.extend(_file_pieces(path, column))
  return pieces


def _file_pieces(path: str, column: str) -> list[tuple]:
  if path.endswith((".txt", ".jsonl")):
    return [("file", path)]
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq
    try:
      pf = pq.ParquetFile(path)
    except Exception as e:
      raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
    if column not in pf.schema_arrow.names:
      raise DataError(f"{path} has no column '{column}' (--text-column); its columns are {pf.schema_arrow.names}")
    return [("parquet", path, g) for g in range(pf.metadata.num_row_groups)]
  raise DataError(f"--input file '{path}' is not .txt, .jsonl or .parquet")


def _hf_pieces(path: str, column: str) -> list[tuple]:
  ds = _load_hf(path)
  if column not in ds.column_names:
    raise DataError(f"--input dataset '{path}' has no column '{column}' (--text-column); its columns are "
                    f"{ds.column_names}")
  return [("hf", path, lo, min(lo + HF_ROWS_PER_PIECE, len(ds))) for lo in range(0, len(ds), HF_ROWS_PER_PIECE)]


def _load_hf(path: str):
  import datasets
  ds = datasets.load_from_disk(path)
  if isinstance(ds, datasets.DatasetDict):
    if "train" not in ds:
      raise DataError(f"--input dataset '{path}' holds the splits {sorted(ds)} and no 'train'")
    ds = ds["train"]
  return ds


def read_piece(piece: tuple, column: str) -> tuple[list[str], int]:
  """(the piece's documents, how many empty or whitespace-only ones were skipped)."""
  kind, path = piece[0], piece[1]
  if kind == "file":
    try:
      docs, report = read_documents(path, column)
    except DataError as e:
      if "holds no documents" in str(e):
        return [], 0
      raise
    return docs, report.empty_documents
  if kind == "parquet":
    import pyarrow.parquet as pq
    texts = pq.ParquetFile(path).read_row_group(piece[2], columns=[column]).column(0).to_pylist()
  else:
    texts = _load_hf(path)[piece[2]:piece[3]][column]
  for i, t in enumerate(texts):
    if t is not None and not isinstance(t, str):
      raise DataError(f"{path} row {i} of piece {piece[2:]}: column '{column}' holds {type(t).__name__}, not text")
  kept = [t for t in texts if t and t.strip()]
  return kept, len(texts) - len(kept)


_worker: dict = {}


def _init_worker(tokenizer: str, tokenizer_type: str) -> None:
  _worker["tok"] = load_tokenizer(tokenizer_type=tokenizer_type, tokenizer_path=tokenizer, bos_id=1, eos_id=2,
                                  pad_id=0)


def tokenize_piece(job: tuple) -> tuple[int, int, int, int]:
  """Writes piece i's documents as shard i: (i, documents, tokens, empty documents skipped)."""
  from array_record.python.array_record_module import ArrayRecordWriter
  i, piece, column, path = job
  tok = _worker["tok"]
  texts, empty = read_piece(piece, column)
  docs = tokens = 0
  writer = ArrayRecordWriter(path + ".tmp", "group_size:1")
  for chunk in range(0, len(texts), 1024):
    for ids in tok.encode_batch(texts[chunk:chunk + 1024]):
      if not ids:
        empty += 1
        continue
      writer.write(np.asarray(ids, "<i4").tobytes())
      docs, tokens = docs + 1, tokens + len(ids)
  writer.close()
  if docs:
    os.replace(path + ".tmp", path)
  else:
    os.remove(path + ".tmp")  # an ArrayRecord file with no records would be rejected at training
  return i, docs, tokens, empty


def pretokenize(args) -> dict:
  if args.tokenizer_type is None:
    args.tokenizer_type = "sentencepiece" if args.tokenizer.endswith(".model") else "hf"
  load_tokenizer(tokenizer_type=args.tokenizer_type, tokenizer_path=args.tokenizer, bos_id=1, eos_id=2, pad_id=0)
  pieces = list_pieces(args.input, args.text_column)
  old = glob.glob(os.path.join(args.output, "*.arrayrecord"))
  if old:  # a glob over the folder would mix them with the new shards
    raise DataError(f"--output '{args.output}' already holds {len(old)} .arrayrecord file(s); choose an empty folder")
  os.makedirs(args.output, exist_ok=True)
  n = len(pieces)
  jobs = [(i, p, args.text_column, os.path.join(args.output, f"shard-{i:05d}-of-{n:05d}.arrayrecord"))
          for i, p in enumerate(pieces)]
  totals = {"documents": 0, "tokens": 0, "empty_documents": 0, "shards": 0}
  start = time.perf_counter()
  from tqdm import tqdm
  bar = tqdm(total=n, unit="piece", desc="pretokenize", disable=args.quiet, file=sys.stderr)
  ctx = multiprocessing.get_context("spawn")
  workers = max(1, min(args.workers, n))
  if workers == 1:
    _init_worker(args.tokenizer, args.tokenizer_type)
    results = map(tokenize_piece, jobs)
  else:
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(args.tokenizer, args.tokenizer_type))
    results = pool.imap_unordered(tokenize_piece, jobs)
  try:
    for _, docs, tokens, empty in results:
      totals["documents"] += docs
      totals["tokens"] += tokens
      totals["empty_documents"] += empty
      totals["shards"] += docs > 0
      bar.update(1)
      bar.set_postfix(docs=totals["documents"], tokens=totals["tokens"])
  finally:
    bar.close()
    if workers > 1:
      pool.terminate()
  if not totals["documents"]:
    raise DataError(f"--input '{args.input}' holds no documents")
  seconds = time.perf_counter() - start
  summary = {**totals, "seconds": round(seconds, 3), "tokens_per_s": round(totals["tokens"] / seconds),
             "output": args.output, "tokenizer": args.tokenizer}
  with open(os.path.join(args.output, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m MaxText.pretokenize", description=__doc__.split("\n\n")[0],
                               epilog="Train on the result: dataset_type=grain grain_train_files=<output> (its *.arrayrecord) "
                                      "tokenize_train_data=false.")
  ap.add_argument("--input", required=True, help="files, globs or folders (comma-separated): .txt, .jsonl, "
                                                 ".parquet, or a save_to_disk dataset folder")
  ap.add_argument("--tokenizer", required=True, help="a sentencepiece .model or an HF tokenizer.json (or its folder)")
  ap.add_argument("--output", required=True, help="folder for the shards (created) and summary.json")
  ap.add_argument("--tokenizer-type", choices=["sentencepiece", "hf"], default=None,
                  help="default: sentencepiece for a .model file, else hf")
  ap.add_argument("--text-column", default="text", help="jsonl field / Parquet or dataset column (default: text)")
  ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
  ap.add_argument("--quiet", action="store_true", help="no progress bar")
  args = ap.parse_args(argv)

  def run():
    s = pretokenize(args)
    print(f"{s['documents']:,} documents, {s['tokens']:,} tokens in {s['shards']} shard(s) -> {s['output']} "
          f"({s['empty_documents']} empty document(s) skipped; {s['seconds']:.1f} s, {s['tokens_per_s']:,} tokens/s)")

  cli.run(run)


if __name__ == "__main__":
  main()
