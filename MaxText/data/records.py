"""Documents of ArrayRecord or Parquet shards and local Hugging Face datasets, by record index.

    table = open_table(config)          # dataset_type=grain: grain_train_files; hf: hf_path
    len(table)                          # records in all files, in file order (files sorted by name)
    table.raw(i)                        # record i as stored: bytes (ArrayRecord), a str or a list of ints
    table.where(i)                      # "shard-00001.arrayrecord record 17": for error messages
    docs = DocumentReader(table, config, tokenizer)
    docs(i)                             # int32 token ids of record i: [bos] + ids + [eos]

What a record holds (`tokenize_train_data`): true, text to tokenize (an ArrayRecord record is UTF-8
bytes; a Parquet / HF column holds strings); false, token ids already (an ArrayRecord record is
little-endian int32, as `python -m MaxText.pretokenize` writes; a Parquet / HF column holds lists of
integers). Either way add_bos / add_eos apply here, so every source gives the packer the same
documents. The column is `train_data_columns` (one name). With use_sft a record is a conversation
(sft.py): an ArrayRecord record is a UTF-8 JSON object, a Parquet / HF row gives the
train_data_columns ([messages] or [prompt, completion]) and the SFT_OPTIONAL_COLUMNS it has; the
document is its ids and loss weights. Nothing is ever downloaded: hf_path is a
folder written by `datasets.Dataset.save_to_disk` or a glob of local .parquet / .json / .jsonl files.

Bad data is one DataError naming the file and record (or column): no file matches the glob, an
empty or truncated shard, a record that fails its checksum or is not UTF-8 / int32, a missing
column, a column of the wrong type, a token id past vocab_size.

A table is pickled into grain's worker processes: open file handles are dropped and reopened there.
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Any

import numpy as np

from MaxText.config.types import Config, ConfigError
from MaxText.data.tokenizer import Tokenizer

SFT_OPTIONAL_COLUMNS = ("tools", "thinking")  # use_sft: read beside train_data_columns when a table has them


def _with_optional(columns: tuple[str, ...], optional: tuple[str, ...], names: list[str]) -> tuple[str, ...]:
  return columns + tuple(c for c in optional if c in names and c not in columns)


class DataError(ConfigError):
  """Bad input data or dataset config: the message names the file and line, or the key."""


def expand_globs(patterns: str, key: str) -> list[str]:
  """The files a comma-separated list of globs names, sorted within each glob; none: DataError."""
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    found = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not found:
      raise DataError(f"{key}='{pattern}' matches no file")
    files.extend(found)
  if not files:
    raise DataError(f"{key} is empty: name the files (a glob)")
  return files


SHARD_SUFFIXES = {"arrayrecord": (".arrayrecord", ".array_record"), "parquet": (".parquet",)}


def _shard_files(patterns: str, key: str, file_type: str) -> list[str]:
  """grain's files: a folder means its shards (`<folder>/*.arrayrecord`, `*.parquet`); a glob that
  matches shards and other files too (pretokenize's summary.json beside its shards) is a DataError
  naming the other file and the glob that would work."""
  suffixes = SHARD_SUFFIXES[file_type]
  parts = [p.strip() for p in patterns.split(",") if p.strip()]
  parts = [os.path.join(p, "*" + suffixes[0]) if os.path.isdir(os.path.expanduser(p)) else p for p in parts]
  files = expand_globs(",".join(parts), key)
  others = [f for f in files if not f.endswith(suffixes)]
  if others and len(others) < len(files):
    glob_ = os.path.join(os.path.dirname(others[0]), "*" + suffixes[0])
    raise DataError(f"{key}='{patterns}' matches {others[0]}, which is not a shard (grain_file_type={file_type}: "
                    f"*{suffixes[0]}): name the shards, e.g. {key}='{glob_}', or give the folder")
  return files


class Table:
  """Records of several files, indexed 0..len-1 in file order."""

  def __init__(self, files: list[str], counts: list[int], columns: tuple[str, ...]):
    """raw(i) is the value of the one column, or with several a dict of them."""
    self.files, self.counts, self.columns = files, counts, columns
    self.column = ", ".join(columns)
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [F+1]
    self.blocks: np.ndarray | None = None  # [K+1] boundaries of records best read together (Parquet row groups)
    self._open: dict[int, Any] = {}

  def __len__(self) -> int:
    return int(self.starts[-1])

  def locate(self, i: int) -> tuple[int, int]:
    """(file index, record within the file) of record i."""
    f = bisect.bisect_right(self.starts, i) - 1
    return f, int(i - self.starts[f])

  def where(self, i: int) -> str:
    f, r = self.locate(i)
    return f"{self.files[f]} record {r}"

  def raw(self, i: int) -> Any:
    raise NotImplementedError

  def __getstate__(self) -> dict:
    return {**self.__dict__, "_open": {}}  # readers are per process


class ArrayRecordTable(Table):

  def __init__(self, files: list[str]):
    from array_record.python.array_record_module import ArrayRecordReader
    counts = []
    for f in files:
      reader = ArrayRecordReader(f)
      if not reader.ok():
        size = os.path.getsize(f)
        raise DataError(f"{f}: not a readable ArrayRecord file ({'empty' if size == 0 else f'{size} bytes'}: "
                        "truncated or not ArrayRecord)")
      n = reader.num_records()
      reader.close()
      if n == 0:
        raise DataError(f"{f}: an ArrayRecord file with no records")
      counts.append(n)
    super().__init__(files, counts, columns=())

  def raw(self, i: int) -> bytes:
    from array_record.python.array_record_module import ArrayRecordReader
    f, r = self.locate(i)
    if f not in self._open:
      self._open[f] = ArrayRecordReader(self.files[f], "readahead_buffer_size:0")
    try:
      return self._open[f].read([r])[0]
    except Exception as e:  # riegeli: a chunk whose hash does not match, a cut file
      raise DataError(f"{self.files[f]} record {r}: corrupt record ({str(e).splitlines()[0][:160]})") from None


def _check_column(schema_names: list[str], column: str, where: str) -> None:
  if column not in schema_names:
    raise DataError(f"{where} has no column '{column}' (train_data_columns); its columns are {schema_names}")


class ParquetTable(Table):
  """Parquet files read one row group at a time (the last few kept)."""

  def __init__(self, files: list[str], columns: tuple[str, ...], optional: tuple[str, ...] = ()):
    """optional: columns read too when every file has them."""
    import pyarrow.parquet as pq
    counts, self.group_rows = [], []
    for f in files:
      try:
        pf = pq.ParquetFile(f)
        meta, names = pf.metadata, pf.schema_arrow.names
      except Exception as e:  # an empty file, a cut footer, not Parquet
        raise DataError(f"{f}: not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
      for column in columns:
        _check_column(names, column, f)
      optional = tuple(c for c in optional if c in names)
      if meta.num_rows == 0:
        raise DataError(f"{f}: a Parquet file with no rows")
      counts.append(meta.num_rows)
      self.group_rows.append(np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
    super().__init__(files, counts, _with_optional(columns, optional, list(optional)))
    self.blocks = np.unique(np.concatenate([self.starts[f] + g for f, g in enumerate(self.group_rows)]))
    self._groups: dict[tuple[int, int], list] = {}

  def raw(self, i: int) -> Any:
    import pyarrow.parquet as pq
    f, r = self.locate(i)
    g = int(np.searchsorted(self.group_rows[f], r, side="right") - 1)
    if (f, g) not in self._groups:
      try:
        if f not in self._open:
          self._open[f] = pq.ParquetFile(self.files[f])
        table = self._open[f].read_row_group(g, columns=list(self.columns))
        values = table.column(0).to_pylist() if len(self.columns) == 1 else table.to_pylist()
      except Exception as e:
        raise DataError(f"{self.files[f]} row group {g}: cannot be read ({str(e).splitlines()[0][:160]})") from None
      if len(self._groups) >= 4:
        self._groups.pop(next(iter(self._groups)))
      self._groups[(f, g)] = values
    return self._groups[(f, g)][r - int(self.group_rows[f][g])]

  def __getstate__(self) -> dict:
    return {**super().__getstate__(), "_groups": {}}


class HFTable(Table):
  """A local `datasets` dataset: a save_to_disk folder (memory-mapped Arrow) or local data files."""

  def __init__(self, path: str, columns: tuple[str, ...], key: str = "hf_path", optional: tuple[str, ...] = ()):
    try:
      import datasets
    except ImportError:
      raise DataError("dataset_type=hf needs the `datasets` package (pip install -r requirements.txt)") from None
    datasets.disable_progress_bars()
    if os.path.isdir(path):
      try:
        ds = datasets.load_from_disk(path)
      except Exception as e:
        raise DataError(f"{key}='{path}' is not a dataset folder written by save_to_disk "
                        f"({str(e).splitlines()[0][:160]})") from None
      if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
          raise DataError(f"{key}='{path}' holds the splits {sorted(ds)} and no 'train'")
        ds = ds["train"]
      files = [path]
    else:
      files = expand_globs(path, key)
      kinds = {os.path.splitext(f)[1] for f in files}
      builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
      if len(kinds) != 1 or next(iter(kinds)) not in builder:
        raise DataError(f"{key}='{path}' must name .parquet or .json/.jsonl files of one kind, got "
                        f"{sorted(kinds)}")
      try:
        ds = datasets.load_dataset(builder[next(iter(kinds))], data_files=files, split="train")
      except Exception as e:
        raise DataError(f"{key}='{path}': cannot be read ({str(e).splitlines()[0][:200]})") from None
    for column in columns:
      _check_column(list(ds.column_names), column, f"{key}='{path}'")
    if len(ds) == 0:
      raise DataError(f"{key}='{path}' holds no rows")
    columns = _with_optional(columns, optional, list(ds.column_names))
    self.ds, self.key = ds.select_columns(list(columns)), key
    super().__init__([path], [len(ds)], columns)

  def where(self, i: int) -> str:
    return f"{self.key}='{self.files[0]}' row {i}"

  def raw(self, i: int) -> Any:
    row = self.ds[int(i)]
    return row[self.columns[0]] if len(self.columns) == 1 else row


def open_table(config: Config, *, eval: bool = False) -> Table:
  """The training files, or with eval=True the held-out ones (grain_eval_files / hf_eval_files)."""
  optional = SFT_OPTIONAL_COLUMNS if config.use_sft else ()
  if config.dataset_type == "hf":
    key = "hf_eval_files" if eval else "hf_path"
    return HFTable(getattr(config, key), tuple(config.train_data_columns), key, optional)
  key = "grain_eval_files" if eval else "grain_train_files"
  files = _shard_files(getattr(config, key), key, config.grain_file_type)
  if config.grain_file_type == "parquet":
    return ParquetTable(files, tuple(config.train_data_columns), optional)
  return ArrayRecordTable(files)


class DocumentReader:
  """Record i -> int32 token ids with BOS/EOS, checked against vocab_size (picklable)."""

  def __init__(self, table: Table, config: Config, tokenizer: Tokenizer | None):
    self.table, self.tokenizer = table, tokenizer
    self.tokenize, self.vocab_size = config.tokenize_train_data, config.vocab_size
    bos = tokenizer.bos_id if tokenizer else config.bos_id
    eos = tokenizer.eos_id if tokenizer else config.eos_id
    self.bos = np.array([bos] * config.add_bos, np.int32)
    self.eos = np.array([eos] * config.add_eos, np.int32)

  def _column(self) -> str:
    return f"column '{self.table.column}' (train_data_columns)" if self.table.column else "the record"

  def __call__(self, i: int) -> np.ndarray:
    value = self.table.raw(i)
    ids = self._text_ids(i, value) if self.tokenize else self._ids(i, value)
    return np.concatenate([self.bos, ids, self.eos])

  def _text_ids(self, i: int, value: Any) -> np.ndarray:
    if isinstance(value, bytes):
      try:
        value = value.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{self.table.where(i)}: not UTF-8 text (byte {e.start}); records of token ids need "
                        "tokenize_train_data=false") from None
    if not isinstance(value, str):
      raise DataError(f"{self.table.where(i)}: {self._column()} holds {type(value).__name__}, not text; for token "
                      "ids set tokenize_train_data=false")
    return np.asarray(self.tokenizer.encode(value), np.int32)

  def _ids(self, i: int, value: Any) -> np.ndarray:
    if isinstance(value, bytes):
      if len(value) % 4:
        raise DataError(f"{self.table.where(i)}: corrupt record ({len(value)} bytes, not int32 token ids); text "
                        "records need tokenize_train_data=true")
      ids = np.frombuffer(value, "<i4").astype(np.int32)
    else:
      try:
        ids = np.asarray(value if value is not None else [], np.int64)
      except (TypeError, ValueError):
        ids = None
      if ids is None or ids.ndim != 1 or isinstance(value, str):
        raise DataError(f"{self.table.where(i)}: {self._column()} holds {type(value).__name__}, not a list of "
                        "token ids; for text set tokenize_train_data=true")
    bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
    if len(bad):
      raise DataError(f"{self.table.where(i)}: token id {int(ids[bad[0]])} at position {int(bad[0])} is outside "
                      f"the vocabulary [0, vocab_size={self.vocab_size})")
    return ids.astype(np.int32)
