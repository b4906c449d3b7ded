"""Packing a stream of documents into rows, in lanes: the rule for grain and hf datasets.

The rule (the file dataset's too, see input_pipeline.PackedCorpus): documents are concatenated into
one stream and cut into rows of L = max_target_length tokens; a document longer than what is left
of a row continues at the start of the lane's next row; no token is dropped and no row is padded.
A row's last target is the first token of the next row. Within a row, segment_ids number the
document pieces 1, 2, ...; positions count from 0 within each piece; weights are 0 where the target
belongs to another document, and otherwise the target token's own loss weight: a document is its
token ids, or (ids, mask) where mask[i] weighs the prediction of token i (SFT: 1 on what the
assistant produces, data/sft.py); plain ids weigh every token 1.

Lanes: the global batch has B rows, and row b of every batch comes from lane b. The documents are
read in one seeded order (an index shuffle, different each epoch, never held in memory) and
dealt round robin: lane b streams documents b, b + B, b + 2B, ... of that order. So a lane's rows
depend only on the data, the seed and B: each process reads only the documents of its own lanes
(its rows of the batch), and the batches are the same for any number of processes or workers.

Whole documents (whole=True, use_sft: a conversation must keep its prompt): a row holds whole
documents only; one that does not fit what is left of the row starts the next row, and the rest of
the row is padding (pad_id, segment 0, weight 0); no target crosses rows. A document longer than
L + 1 tokens is an error (sft.py cuts or drops those first).

A lane's position is a cursor (j, offset): the row starts at token `offset` of the lane's document
at order position j. `PackedLanes` is a grain IterDataset over some lanes; its iterator's state
is their cursors, and each element carries the cursors after it ("cursors"), so the consumer knows
the exact position of every batch it took even when grain's worker processes read ahead.
"""

from __future__ import annotations

from typing import Callable, Sequence

import grain
import numpy as np

from MaxText.data.records import DataError

Document = np.ndarray | tuple[np.ndarray, np.ndarray]  # int32 ids [n], or (ids [n], float32 mask [n])
Cursor = tuple[int, int]  # (order position j of the row's first document, token offset in it)
_MAX_EMPTY_DOCUMENTS = 10_000  # consecutive documents of no tokens before a lane gives up


def split_document(doc: Document) -> tuple[np.ndarray, np.ndarray | None]:
  """(ids [n], mask [n] or None: every token weighs 1)."""
  return doc if isinstance(doc, tuple) else (doc, None)


def pack_row(read: Callable[[int], Document], cursor: Cursor, stride: int, seq_len: int, *,
             whole: bool = False, pad_id: int = 0) -> tuple[dict[str, np.ndarray], Cursor]:
  """(row, next cursor): the row of L inputs (and L targets) starting at `cursor`, reading documents
  j, j + stride, ... through `read(j)` -> a Document. whole: whole documents only (module docstring)."""
  L = seq_len
  j, offset = cursor
  toks, masks, segs, poss = [], [], [], []
  n, seg, empty, nxt = 0, 0, 0, None
  while n < L + 1:
    doc, mask = split_document(read(j))
    if whole and len(doc) > L + 1:
      raise DataError(f"a document of {len(doc)} tokens cannot be packed whole into a row of max_target_length + 1 "
                      f"= {L + 1} tokens")
    if whole and n + len(doc) > L + 1:  # it does not fit the rest of this row: it starts the next one
      nxt = (j, 0)
      break
    piece = doc[offset:offset + L + 1 - n]
    if len(piece):
      seg += 1
      toks.append(piece)
      masks.append(np.ones(len(piece), np.float32) if mask is None else mask[offset:offset + len(piece)])
      segs.append(np.full(len(piece), seg, np.int32))
      poss.append(np.arange(len(piece), dtype=np.int32))
      if n + len(piece) > L and not whole:  # this piece holds stream token L: the next row starts there
        nxt = (j, offset + L - n)
      n += len(piece)
      empty = 0
    else:
      empty += 1
      if empty > _MAX_EMPTY_DOCUMENTS:
        raise DataError(f"{_MAX_EMPTY_DOCUMENTS} documents in a row hold no tokens (add_bos=add_eos=false and "
                        "empty texts?)")
    if n < L + 1 or whole:
      j, offset = j + stride, 0
  if whole:
    nxt = nxt or (j, 0)  # the row ended exactly full: the next row starts at the next document
    pad = L + 1 - n  # [pad] tokens of segment 0, weight 0
    toks.append(np.full(pad, pad_id, np.int32))
    masks.append(np.zeros(pad, np.float32))
    segs.append(np.zeros(pad, np.int32))
    poss.append(np.zeros(pad, np.int32))
  tok, seg_ids, pos = np.concatenate(toks), np.concatenate(segs), np.concatenate(poss)  # [L+1]
  mask = np.concatenate(masks)  # [L+1] each token's weight as a target
  row = {
      "inputs": tok[:L],
      "targets": tok[1:],
      "segment_ids": seg_ids[:L],
      "positions": pos[:L],
      "weights": (seg_ids[1:] == seg_ids[:L]) * mask[1:],
  }
  return row, nxt


def whole_row_starts(lengths: np.ndarray, seq_len: int) -> np.ndarray:
  """[R+1]: the first of each row's documents of `lengths` [N] (in stream order) packed whole into rows
  of seq_len + 1 tokens (pack_row's whole rule, for the file dataset's PackedCorpus), then N."""
  firsts, used = [0], 0
  for k, n in enumerate(lengths.tolist()):
    if used + n > seq_len + 1:  # does not fit the rest of the row: starts the next one
      firsts.append(k)
      used = 0
    used += n
  return np.array(firsts + [len(lengths)], np.int64)


class PackedLanes(grain.IterDataset):
  """Rows of `lanes` (indices among num_lanes), one element per step: dict of [len(lanes), L] arrays,
  plus "cursors" [len(lanes), 2] int64 after it; whole: whole documents only (use_sft). grain's mp_prefetch gives worker w the lanes w::W
  (set_slice)."""

  def __init__(self, read: Callable[[int], Document], *, lanes: Sequence[int], num_lanes: int, seq_len: int,
               cursors: Sequence[Cursor] | None = None, whole: bool = False, pad_id: int = 0):
    super().__init__()
    self.read, self.num_lanes, self.seq_len = read, num_lanes, seq_len
    self.whole, self.pad_id = whole, pad_id
    self.lanes = list(lanes)
    self.cursors = [tuple(c) for c in cursors] if cursors is not None else [(b, 0) for b in self.lanes]

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice
    self.lanes, self.cursors = self.lanes[sl], self.cursors[sl]

  def __iter__(self) -> PackedLanesIterator:
    return PackedLanesIterator(self)

  def __str__(self) -> str:
    return f"PackedLanes(lanes={len(self.lanes)} of {self.num_lanes}, seq_len={self.seq_len})"


class PackedLanesIterator(grain.DatasetIterator):

  def __init__(self, ds: PackedLanes):
    super().__init__()
    self.ds = ds
    self.cursors = list(ds.cursors)
    self._docs: list[dict[int, Document]] = [{} for _ in ds.lanes]  # per lane: documents of its last row

  def __next__(self) -> dict[str, np.ndarray]:
    rows = []
    for k in range(len(self.ds.lanes)):
      cache = self._docs[k]

      def read(j: int, cache=cache) -> Document:
        if j not in cache:
          cache[j] = self.ds.read(j)
        return cache[j]

      row, self.cursors[k] = pack_row(read, self.cursors[k], self.ds.num_lanes, self.ds.seq_len,
                                      whole=self.ds.whole, pad_id=self.ds.pad_id)
      for j in [j for j in cache if j < self.cursors[k][0]]:
        del cache[j]  # a long document stays cached (read and tokenized once) while its rows last
      rows.append(row)
    L = self.ds.seq_len
    out = {k: np.stack([r[k] for r in rows]) if rows else np.zeros((0, L), np.float32 if k == "weights" else np.int32)
           for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
    out["cursors"] = np.array(self.cursors, np.int64).reshape(-1, 2)
    return out

  def get_state(self) -> dict:
    return {"cursors": [list(c) for c in self.cursors]}

  def set_state(self, state: dict) -> None:
    self.cursors = [tuple(int(x) for x in c) for c in state["cursors"]]
    self._docs = [{} for _ in self.ds.lanes]
