"""Reading a dataset_type=file dataset: a .txt or .jsonl file, or a folder searched recursively for
them (sorted; other files counted and ignored), into documents (read_documents: .txt paragraphs, or
each .jsonl record's `jsonl_text_field`) or records (read_jsonl_records: use_sft conversations), with a
ReadReport of everything skipped. Bad input raises records.DataError naming the file and line."""

from __future__ import annotations

import dataclasses
import json
import os

from MaxText.data.records import DataError


@dataclasses.dataclass
class ReadReport:
  """What reading a dataset found, and everything it skipped (logged once, kept on the iterator)."""

  files: list[str] = dataclasses.field(default_factory=list)
  ignored_files: list[str] = dataclasses.field(default_factory=list)
  documents: int = 0
  blank_jsonl_lines: int = 0
  empty_documents: int = 0
  tokens: int = 0

  def summary(self) -> str:
    return (f"{self.documents} documents, {self.tokens} tokens from {len(self.files)} file(s); skipped "
            f"{self.empty_documents} empty document(s), {self.blank_jsonl_lines} blank jsonl line(s), "
            f"{len(self.ignored_files)} file(s) that are not .txt/.jsonl")


def _list_files(path: str, report: ReadReport) -> list[str]:
  if not path:
    raise DataError("dataset_path is empty: dataset_type=file needs a .txt/.jsonl file or a folder of them")
  if os.path.isfile(path):
    if not path.endswith((".txt", ".jsonl")):
      raise DataError(f"dataset_path='{path}' is neither a .txt nor a .jsonl file")
    return [path]
  if not os.path.isdir(path):
    raise DataError(f"dataset_path='{path}' does not exist")
  files = []
  for root, dirs, names in os.walk(path):
    dirs.sort()
    for name in sorted(names):
      full = os.path.join(root, name)
      (files if name.endswith((".txt", ".jsonl")) and not name.startswith(".") else report.ignored_files).append(full)
  if not files:
    raise DataError(f"dataset_path='{path}' is a folder with no .txt or .jsonl files "
                    f"({len(report.ignored_files)} other file(s))")
  return files


def _read_text(path: str) -> str:
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"cannot read {path}: {e}") from None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise DataError(f"{path}:{line}: not valid UTF-8 (byte offset {e.start})") from None


def _lines(path: str) -> list[str]:
  """The file's lines: split on newlines only (str.splitlines also splits on form feeds, U+2028, ...)."""
  lines = [line.removesuffix("\r") for line in _read_text(path).split("\n")]
  if lines and lines[-1] == "":
    lines.pop()  # the final newline ends the last line; it does not start an empty one
  return lines


def _txt_documents(path: str) -> list[str]:
  docs, para = [], []
  for line in _lines(path):
    if line.strip():
      para.append(line)
    elif para:
      docs.append("\n".join(para))
      para = []
  if para:
    docs.append("\n".join(para))
  return docs


def _jsonl_records(path: str, report: ReadReport) -> list[tuple[int, dict]]:
  """(line number, JSON object) of each non-blank line."""
  records = []
  for n, line in enumerate(_lines(path), 1):
    if not line.strip():
      report.blank_jsonl_lines += 1
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
      raise DataError(f"{path}:{n}: a jsonl line must be a JSON object, got {type(record).__name__}")
    records.append((n, record))
  return records


def read_jsonl_records(path: str) -> tuple[list[tuple[str, dict]], ReadReport]:
  """use_sft: ("file:line", record) of every .jsonl record under `path` (a .txt file is an error)."""
  report, out = ReadReport(), []
  for f in _list_files(path, report):
    if not f.endswith(".jsonl"):
      raise DataError(f"{f}: use_sft reads conversations from .jsonl files (one JSON object per line), not .txt")
    report.files.append(f)
    out += [(f"{f}:{n}", record) for n, record in _jsonl_records(f, report)]
  if not out:
    raise DataError(f"dataset_path='{path}' holds no records ({report.summary()})")
  return out, report


def _jsonl_documents(path: str, field: str, report: ReadReport) -> list[str]:
  docs = []
  for n, record in _jsonl_records(path, report):
    if field not in record:
      raise DataError(f"{path}:{n}: the record has no field '{field}' (jsonl_text_field); "
                      f"its fields are {sorted(record)}")
    text = record[field]
    if not isinstance(text, str):
      raise DataError(f"{path}:{n}: field '{field}' (jsonl_text_field) holds a {type(text).__name__}, not a string")
    docs.append(text)
  return docs


def read_documents(path: str, jsonl_text_field: str) -> tuple[list[str], ReadReport]:
  """The documents of a .txt/.jsonl file or folder, in file order, with a count of what was skipped."""
  report = ReadReport()
  docs = []
  for f in _list_files(path, report):
    report.files.append(f)
    found = _txt_documents(f) if f.endswith(".txt") else _jsonl_documents(f, jsonl_text_field, report)
    kept = [d for d in found if d.strip()]
    report.empty_documents += len(found) - len(kept)
    docs.extend(kept)
  report.documents = len(docs)
  if not docs:
    raise DataError(f"dataset_path='{path}' holds no documents ({report.summary()})")
  return docs, report
