"""Training batches from ArrayRecord / Parquet shards (dataset_type=grain) and local Hugging Face
datasets (dataset_type=hf): read (records.py), shuffled, packed in lanes (packing.py), on grain.

    data = create_stream_iterator(config, process_index=0, process_count=1)
    batch = next(data)          # the same keys and shapes as every other dataset (input_pipeline.BATCH_KEYS)
    state = data.get_state()    # JSON: the step and each lane's cursor (every process's, gathered)
    data.set_state(state)       # the next batch is exactly the one the saved run would have seen

Each epoch reads every record once, in an order shuffled by `seed` (grain's index shuffle: a
different permutation per epoch, computed per index). grain_worker_count worker processes
(grain's mp_prefetch) each read and pack a share of this process's lanes; the batch is put back
together in lane order, so the batches do not depend on the number of workers or processes, and a
state saved with one count resumes with another.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import grain
import numpy as np
from grain.experimental import index_shuffle

from MaxText.config.types import Config
from MaxText.data.packing import Document, PackedLanes
from MaxText.data.records import DataError, DocumentReader, Table, open_table
from MaxText.data.sft import ConversationEncoder, ConversationReader
from MaxText.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

_ORDER_SALT = 0x5EED_0D0C
_BLOCK_SALT = 0x0B10C
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


class OrderedDocuments:
  """Order position j (any j >= 0: epoch j // N) -> the token ids of its record (picklable).

  Each epoch is a permutation of the N records by grain's index shuffle (computed per index, nothing
  held in memory; seed + epoch). A table read in blocks (Parquet: a row group is decoded whole) is
  shuffled in two levels instead: the blocks in a seeded order, then the records within each block,
  so the lanes reading neighbouring positions share the few blocks in use, not one block per record.
  One block is the same order as the flat shuffle.
  """

  def __init__(self, reader: DocumentReader | ConversationReader, seed: int):
    self.reader = reader
    self.n = len(reader.table)
    self.seed = (seed ^ _ORDER_SALT) % 2**32
    self.blocks = reader.table.blocks  # [K+1] record boundaries, or None
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def record(self, j: int) -> int:
    epoch, i = divmod(int(j), self.n)
    if self.blocks is None:
      return index_shuffle(i, max_index=self.n - 1, seed=(self.seed + epoch) % 2**32, rounds=4)
    order, cum = self._epoch(epoch)
    s = int(np.searchsorted(cum, i, side="right") - 1)  # the s-th block of this epoch
    b = int(order[s])
    size = int(self.blocks[b + 1] - self.blocks[b])
    block_seed = (self.seed + b * 0x9E3779B1 + epoch) % 2**32
    return int(self.blocks[b]) + index_shuffle(i - int(cum[s]), max_index=size - 1, seed=block_seed, rounds=4)

  def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(block order [K], each one's first position in the epoch [K+1])."""
    if epoch not in self._epochs:
      if len(self._epochs) >= 4:
        self._epochs.pop(min(self._epochs))
      k = len(self.blocks) - 1
      seed = ((self.seed ^ _BLOCK_SALT) + epoch) % 2**32
      order = np.array([index_shuffle(s, max_index=k - 1, seed=seed, rounds=4) for s in range(k)], np.int64)
      sizes = np.diff(self.blocks)[order]
      self._epochs[epoch] = order, np.concatenate([[0], np.cumsum(sizes)])
    return self._epochs[epoch]

  def __call__(self, j: int) -> Document:
    return self.reader(self.record(j))


class StreamIterator(Iterator[dict[str, np.ndarray]]):
  """This process's rows of each batch: lanes [first_lane, first_lane + local_lanes) of num_lanes."""

  def __init__(self, read: OrderedDocuments, *, dataset_type: str, fingerprint: dict[str, Any], num_lanes: int,
               first_lane: int, local_lanes: int, seq_len: int, workers: int, prefetch: int,
               tokenizer: Tokenizer | None, table: Table, whole: bool = False, pad_id: int = 0):
    self.read, self.dataset_type, self.fingerprint = read, dataset_type, fingerprint
    self.whole, self.pad_id = whole, pad_id  # packing.py: whole documents only (use_sft)
    self.num_lanes, self.first_lane, self.seq_len = num_lanes, first_lane, seq_len
    self.lanes = list(range(first_lane, first_lane + local_lanes))
    self.workers = min(workers, local_lanes)
    self.prefetch, self.tokenizer, self.table = prefetch, tokenizer, table
    self.report = None
    self.step = 0
    self._cursors = [(b, 0) for b in self.lanes]
    self._it = None
    self._start()

  def _start(self) -> None:
    self.close()
    ds = PackedLanes(self.read, lanes=self.lanes, num_lanes=self.num_lanes, seq_len=self.seq_len,
                     cursors=self._cursors, whole=self.whole, pad_id=self.pad_id)
    if self.workers:
      from absl import flags
      if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags; our CLI does not use absl
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                       per_worker_buffer_size=self.prefetch),
                          worker_init_fn=_die_with_parent)
    self._it = iter(ds)

  def __iter__(self) -> StreamIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    n = len(self.lanes)
    w = max(self.workers, 1)
    out = {k: np.zeros((n, self.seq_len), np.float32 if k == "weights" else np.int32) for k in ROW_KEYS}
    cursors = np.zeros((n, 2), np.int64)
    for i in range(w):  # mp_prefetch interleaves its workers: one element (this step's rows) from each
      try:
        chunk = next(self._it)
      except DataError as e:  # grain appends a note on its traceback filtering: keep the one line
        raise DataError(str(e).split("\n")[0]) from None
      for k in ROW_KEYS:
        out[k][i::w] = chunk[k]  # worker i packs the lanes i::w (grain's slice of PackedLanes)
      cursors[i::w] = chunk["cursors"]
    self._cursors = [tuple(int(x) for x in c) for c in cursors]
    self.step += 1
    return out

  def get_state(self) -> dict[str, Any]:
    first, cursors = self.first_lane, [list(c) for c in self._cursors]
    import jax
    if jax.process_count() > 1:  # every process saves every lane: any process count resumes it
      first, cursors = 0, _gather_cursors(self.first_lane, cursors, self.num_lanes)
    return {"dataset_type": self.dataset_type, "step": self.step, **self.fingerprint,
            "first_lane": first, "cursors": cursors}

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "cursors" not in state or "step" not in state:
      raise DataError(f"a {self.dataset_type} data state is a dict with 'step' and 'cursors', got "
                      f"{str(state)[:200]}")
    if state.get("dataset_type") != self.dataset_type:
      raise DataError(f"the data state is of dataset_type={state.get('dataset_type')!r} but this run has "
                      f"dataset_type={self.dataset_type}")
    changed = {k: (state.get(k), v) for k, v in self.fingerprint.items() if state.get(k) != v}
    if changed:
      raise DataError(f"the data state was saved with another dataset or batching (was, now): {changed}")
    first, cursors = int(state.get("first_lane", 0)), state["cursors"]
    lo = self.first_lane - first
    if lo < 0 or lo + len(self.lanes) > len(cursors):
      raise DataError(f"the data state holds lanes {first}..{first + len(cursors) - 1}, not this process's "
                      f"{self.lanes[0]}..{self.lanes[-1]}")
    self._cursors = [tuple(int(x) for x in c) for c in cursors[lo:lo + len(self.lanes)]]
    self.step = int(state["step"])
    self._start()

  def close(self) -> None:
    if self._it is not None and hasattr(self._it, "close"):
      self._it.close()
    self._it = None


def _die_with_parent(worker_index: int, worker_count: int) -> None:
  """A worker ends with its parent, also when the parent is killed (kill -9): none lingers holding
  the parent's stdout or the data files. (A watch thread: PR_SET_PDEATHSIG would follow the thread
  that started the worker, not the process.)"""
  del worker_index, worker_count
  import os
  import threading
  import time
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _gather_cursors(first: int, cursors: list, num_lanes: int) -> list:
  """Every process's lane cursors -> the cursors of all num_lanes lanes (a collective: all call it)."""
  from MaxText.runtime.distributed import process_allgather
  blob = np.frombuffer(json.dumps([first, cursors]).encode(), np.uint8)
  size = int(np.max(process_allgather(np.array([len(blob)]))))
  padded = np.zeros(size, np.uint8)
  padded[:len(blob)] = blob
  every = process_allgather(padded)  # [processes, size]
  out: list = [None] * num_lanes
  for row in np.asarray(every):
    f, cs = json.loads(bytes(row).rstrip(b"\0").decode())
    out[f:f + len(cs)] = cs
  return out


def create_stream_iterator(config: Config, *, process_index: int, process_count: int, start_step: int = 0,
                           tokenizer: Tokenizer | None = None, prefetch: int = 2, eval: bool = False) -> StreamIterator:
  """eval=True: the held-out files (grain_eval_files / hf_eval_files), read in the main process."""
  table = open_table(config, eval=eval)
  if config.tokenize_train_data or config.use_sft:
    tokenizer = tokenizer or load_tokenizer(config)
    if tokenizer.vocab_size > config.vocab_size:
      raise DataError(f"the tokenizer at tokenizer_path='{tokenizer.path}' has {tokenizer.vocab_size} tokens but "
                      f"vocab_size={config.vocab_size}; set vocab_size >= {tokenizer.vocab_size}")
  reader = ConversationReader(table, ConversationEncoder.from_config(config, tokenizer)) if config.use_sft \
      else DocumentReader(table, config, tokenizer)
  read = OrderedDocuments(reader, config.seed)
  local = config.global_batch_size // process_count
  source = table.files[0] if len(table.files) == 1 else f"{table.files[0]} ... ({len(table.files)} files)"
  fingerprint = {"seed": config.seed, "global_batch_size": config.global_batch_size,
                 "max_target_length": config.max_target_length, "num_records": len(table)}
  log.info("dataset_type=%s %s: %d records in %d file(s); %d lanes here", config.dataset_type, source, len(table),
           len(table.files), local)
  data = StreamIterator(read, dataset_type=config.dataset_type, fingerprint=fingerprint,
                        num_lanes=config.global_batch_size, first_lane=process_index * local, local_lanes=local,
                        seq_len=config.max_target_length, workers=0 if eval else config.grain_worker_count,
                        prefetch=prefetch, tokenizer=tokenizer, table=table, whole=config.use_sft,
                        pad_id=config.pad_id)
  for _ in range(start_step):
    next(data)
  return data


class HeldOutBatches:
  """The first eval_steps batches of the held-out files, read once: source[i] is eval batch i."""

  def __init__(self, config: Config, *, process_index: int, process_count: int, tokenizer: Tokenizer | None):
    it = create_stream_iterator(config, process_index=process_index, process_count=process_count,
                                tokenizer=tokenizer, eval=True)
    self.source = [next(it) for _ in range(config.eval_steps)]
    self.tokenizer, self.dataset_type = it.tokenizer, config.dataset_type
    it.close()

  def close(self) -> None:
    pass
