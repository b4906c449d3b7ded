"""Training batches: a learnable synthetic task, or text files tokenized and packed (on grain).

    data = create_data_iterator(config, start_step=0)
    batch = next(data)         # the batch of step 0, then 1, 2, ...
    state = data.get_state()   # {"dataset_type": ..., "step": n, ...}: JSON; n = the next batch's step
    data.set_state(state)      # the next batch is batch n, exactly

A batch is a dict of numpy arrays [global_batch_size / process_count, max_target_length]:
  inputs       int32  token ids
  targets      int32  the next token of the packed stream: targets[i] = stream[i + 1] (pad after the end)
  segment_ids  int32  1, 2, ... per document (piece) within the row, 0 on padding
  positions    int32  position within the row's piece of its document, from 0
  weights      float32 1 where targets[i] is the next token of the same document, else 0 (padding,
               and the last token of each document, whose next token starts another document)

Both datasets are random access: batch n is a pure function of (data, config, n), so resuming is
exact and cheap, and grain's thread prefetch may read ahead without changing what comes out.

synthetic (dataset_type=synthetic): each row is one arithmetic progression modulo M over the
  "content" ids (every id below vocab_size except pad/bos/eos, in order; M of them):
  v_i = (v_0 + i * d) mod M, token_i = content_ids[v_i], with v_0 uniform in [0, M) and the step d
  drawn from SYNTHETIC_STEPS, both per row from a PRNG seeded by (seed, step, row). From token 2 on,
  the next token is determined by the two before it (v_{i+1} = 2 v_i - v_{i-1} mod M): a model must
  infer d from context. Token 0 -> 1 is a guess among len(SYNTHETIC_STEPS) choices.

synthetic_retrieval (dataset_type=synthetic_retrieval): multi-query associative recall over a long
  context, the task of benchmarks/dsa_study.py. The content ids are split into retrieval_values value
  ids, retrieval_keys key ids and the rest filler. Each row (a PRNG seeded by (seed, step, row)):
  retrieval_pairs (key, value) pairs, distinct keys and random values, each at a uniform random place
  in a context of filler tokens: two adjacent tokens, key then value (retrieval_pair_tokens=2: a
  query needs two hops, the value's position must first read its key), or one token of its own per
  (key, value) combination (retrieval_pair_tokens=1: one hop; the vocabulary then holds keys x
  values pair ids); then, in the row's last
  2 * retrieval_queries tokens, retrieval_queries of those keys (distinct, random order), each
  followed by its value. weights are 1 only where the input is a queried key (the target is its
  value), so the loss and accuracy count retrieval alone: guessing gets 1/retrieval_values, and a
  query can answer only by attending to its pair (far back, anywhere in the context).

file (dataset_type=file): `dataset_path` is a .txt or .jsonl file, or a folder searched recursively
  for them (sorted; other files are counted and ignored). .txt: one document per paragraph
  (paragraphs are separated by blank lines; a paragraph keeps its inner newlines). .jsonl: one JSON
  object per line, its text in the field `jsonl_text_field` (blank lines are counted and skipped).
  Documents whose text is empty or whitespace are counted and skipped. Each document becomes
  [bos] + tokens + [eos] (add_bos / add_eos). Packing concatenates the documents of an epoch (in an
  order shuffled per epoch by `seed`) into one stream and cuts it into rows of max_target_length:
  documents longer than a row are split, no token is dropped, and only the last row of each epoch
  is padded. A row's last target is the first token of the next row, so splitting a document loses
  no prediction. The whole corpus is tokenized once, in memory, when the iterator is created.

grain (dataset_type=grain: ArrayRecord or Parquet shards) and hf (dataset_type=hf: a local Hugging
Face dataset): streamed, never held in memory, packed by the same rule in lanes, read by grain
worker processes; see streams.py (records.py reads the files, packing.py packs).

use_sft: the records are conversations (file: .jsonl only); sft.py renders each into ids and
per-token weights (1 on what the assistant produces), which the packers multiply into `weights`.
Both packers then keep each conversation whole in one row (PackedCorpus(whole=True), packing.py):
one that does not fit the rest of a row starts the next, and the rest of the row is padding.
"""

from __future__ import annotations

import logging
import math
import operator
import sys
import threading
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from MaxText.config.types import Config
from MaxText.data.documents import ReadReport, read_documents, read_jsonl_records
from MaxText.data.packing import whole_row_starts
from MaxText.data.records import DataError
from MaxText.data.sft import ConversationEncoder
from MaxText.data.streams import HeldOutBatches, StreamIterator, create_stream_iterator
from MaxText.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SYNTHETIC_STEPS = (1, 2, 3, 4)  # the progression steps d a synthetic row may use
_SYNTHETIC_SALT = 0x5EED_DA7A   # keeps the data PRNG streams apart from other uses of `seed`
_SHUFFLE_SALT = 0x5EED_5FF1
_RETRIEVAL_SALT = 0x5EED_4E7A  # synthetic_retrieval's training rows
_EVAL_SALT = 0x5EED_E7A1        # the held-out synthetic stream: rows no training step ever draws
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


# ------------------------------------------------------------------------------------- packing


class PackedCorpus:
  """The tokenized corpus, packed: row g is a pure function of (corpus, seed, seq_len, g).

  Epoch e streams the documents in order perm_e (a seeded permutation; identity when shuffle is
  off) and is cut into rows_per_epoch = ceil(tokens / seq_len) rows; global row g is row g % R of
  epoch g // R.

  whole=True (use_sft): rows hold whole documents only (packing.py's rule): epoch e's stream is
  dealt greedily into rows of at most seq_len + 1 tokens, a document that does not fit the rest of a
  row starting the next one, the rest padded; its row count R_e depends on its order, and global row
  g is found by counting the rows of epochs 0, 1, ... (kept as ints).
  """

  def __init__(self, docs: Sequence[Sequence[int]], *, seq_len: int, pad_id: int, seed: int, shuffle: bool = True,
               masks: Sequence[Sequence[float]] | None = None, whole: bool = False):
    """masks: per document, each token's weight as a target (packing.Document); None = all 1."""
    lengths = np.array([len(d) for d in docs], np.int64)
    if np.any(lengths == 0):
      raise ValueError("PackedCorpus needs documents of at least one token")
    if whole and np.any(lengths > seq_len + 1):
      raise ValueError(f"whole=True needs documents of at most seq_len + 1 = {seq_len + 1} tokens")
    self.whole = whole
    self._epoch_rows: list[int] = []  # whole: R_e of epochs 0, 1, ... counted so far
    self.doc_starts = np.concatenate([[0], np.cumsum(lengths)])                    # [N+1]
    self.tokens = np.concatenate([np.asarray(d, np.int32) for d in docs])          # [T]
    self.mask = None if masks is None else np.concatenate([np.asarray(m, np.float32) for m in masks])  # [T]
    self.lengths = lengths
    self.num_documents = len(docs)
    self.tokens_per_epoch = int(self.doc_starts[-1])
    self.seq_len = seq_len
    self.pad_id = pad_id
    self.seed = seed
    self.shuffle = shuffle
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
    self._lock = threading.Lock()
    self.rows_per_epoch = len(self._epoch(0)[2]) - 1 if whole else math.ceil(self.tokens_per_epoch / seq_len)

  def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(perm [N]: document of each stream slot, cum [N+1]: stream offset of each slot,
    whole: firsts [R_e+1]: the first slot of each row, then N; else None)."""
    with self._lock:
      if epoch not in self._epochs:
        if len(self._epochs) >= 4:  # the epochs in use: a batch (and the read-ahead) spans few
          self._epochs.pop(min(self._epochs))
        self._epochs[epoch] = self._order(epoch)
      return self._epochs[epoch]

  def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    if self.shuffle:
      rng = np.random.default_rng([_SHUFFLE_SALT, self.seed % 2**63, epoch])
      perm = rng.permutation(self.num_documents)
    else:
      perm = np.arange(self.num_documents)
    cum = np.concatenate([[0], np.cumsum(self.lengths[perm])])
    if not self.whole:
      return perm, cum, None
    return perm, cum, whole_row_starts(self.lengths[perm], self.seq_len)

  def _locate(self, g: int) -> tuple[int, int]:
    """(epoch, row within it) of global row g."""
    if not self.whole:
      return divmod(g, self.rows_per_epoch)
    epoch = 0
    while True:
      if epoch == len(self._epoch_rows):
        self._epoch_rows.append(len(self._epoch(epoch)[2]) - 1)
      if g < self._epoch_rows[epoch]:
        return epoch, g
      g, epoch = g - self._epoch_rows[epoch], epoch + 1

  def row(self, g: int) -> dict[str, np.ndarray]:
    L = self.seq_len
    epoch, r = self._locate(int(g))
    perm, cum, firsts = self._epoch(epoch)
    if firsts is None:
      start, T = r * L, self.tokens_per_epoch            # the stream cut every L tokens
    else:
      start, T = int(cum[firsts[r]]), int(cum[firsts[r + 1]])  # whole documents: T - start <= L + 1
    p = start + np.arange(L + 1)                         # [L+1] stream positions: L inputs + the last target
    valid = p < T
    pc = np.minimum(p, T - 1)
    slot = np.searchsorted(cum, pc, side="right") - 1    # [L+1] stream slot (document) of each position
    at = self.doc_starts[perm[slot]] + (pc - cum[slot])  # [L+1] index into self.tokens
    tok = np.where(valid, self.tokens[at], self.pad_id).astype(np.int32)
    s = slot[:L]
    v = valid[:L]
    weights = (valid[1:] & (slot[1:] == s)).astype(np.float32)  # [L]
    if self.mask is not None:
      weights *= self.mask[at[1:]]
    return {
        "inputs": tok[:L],
        "targets": tok[1:],
        "segment_ids": np.where(v, s - s[0] + 1, 0).astype(np.int32),
        "positions": np.where(v, p[:L] - np.maximum(cum[s], start), 0).astype(np.int32),
        "weights": weights,
    }


# ------------------------------------------------------------------------------------- batch sources


class _Batches:
  """A grain random-access source of (process-local) batches, indexed by step; endless."""

  def __init__(self, global_batch_size: int, process_index: int, process_count: int):
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.first_row = process_index * self.local_batch_size

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    rows = [self.row(step, self.first_row + b) for b in range(self.local_batch_size)]
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}

  def row(self, step: int, b: int) -> dict[str, np.ndarray]:
    raise NotImplementedError


def _content_ids(config: Config) -> np.ndarray:
  """Every id below vocab_size except pad/bos/eos, in order: the synthetic tasks' tokens."""
  special = {config.pad_id, config.bos_id, config.eos_id}
  return np.array([i for i in range(config.vocab_size) if i not in special], np.int32)


class SyntheticBatches(_Batches):
  """Arithmetic progressions modulo the content ids (see the module docstring)."""

  def __init__(self, config: Config, process_index: int, process_count: int, salt: int = _SYNTHETIC_SALT):
    super().__init__(config.global_batch_size, process_index, process_count)
    self.salt = salt
    self.content_ids = _content_ids(config)  # [M]
    if len(self.content_ids) < 2:
      raise DataError(f"vocab_size={config.vocab_size} leaves {len(self.content_ids)} ids besides pad_id/bos_id/"
                      "eos_id; dataset_type=synthetic needs at least 2")
    self.seed = config.seed
    self.seq_len = config.max_target_length

  def row(self, step: int, b: int) -> dict[str, np.ndarray]:
    L, M = self.seq_len, len(self.content_ids)
    rng = np.random.default_rng([self.salt, self.seed % 2**63, step, b])
    v0 = rng.integers(0, M)
    d = SYNTHETIC_STEPS[rng.integers(0, len(SYNTHETIC_STEPS))]
    tok = self.content_ids[(v0 + d * np.arange(L + 1, dtype=np.int64)) % M]  # [L+1]
    return {
        "inputs": tok[:L],
        "targets": tok[1:],
        "segment_ids": np.ones(L, np.int32),
        "positions": np.arange(L, dtype=np.int32),
        "weights": np.ones(L, np.float32),
    }


class RetrievalBatches(_Batches):
  """Multi-query associative recall: key-value pairs scattered in filler, queries at the end (module doc)."""

  def __init__(self, config: Config, process_index: int, process_count: int, salt: int = _RETRIEVAL_SALT):
    super().__init__(config.global_batch_size, process_index, process_count)
    self.salt, self.seed, self.seq_len = salt, config.seed, config.max_target_length
    content = _content_ids(config)
    nv, nk = config.retrieval_values, config.retrieval_keys
    self.fused = config.retrieval_pair_tokens == 1
    used = nv + nk + (nk * nv if self.fused else 0)
    if used >= len(content):
      raise DataError(f"synthetic_retrieval uses {used} ids (retrieval_values={nv}, retrieval_keys={nk}"
                      f"{', and their key x value pair tokens' if self.fused else ''}) and needs filler ids too: "
                      f"vocab_size={config.vocab_size} has {len(content)} content ids; raise it to > {used + 3}")
    self.values, self.keys = content[:nv], content[nv:nv + nk]  # disjoint id sets
    self.pair_ids = content[nv + nk:used].reshape(nk, nv) if self.fused else None  # [nk,nv]: the pair (i, j)
    self.filler = content[used:]
    self.pairs, self.queries, self.vocab_size = config.retrieval_pairs, config.retrieval_queries, config.vocab_size

  def row(self, step: int, b: int) -> dict[str, np.ndarray]:
    L, n, q = self.seq_len, self.pairs, self.queries
    rng = np.random.default_rng([self.salt, self.seed % 2**63, step, b])
    ki = rng.choice(len(self.keys), n, replace=False)  # [n] distinct keys (indices)
    vi = rng.integers(0, len(self.values), n)  # [n]
    keys, values = self.keys[ki], self.values[vi]
    c = self.context_length(L)
    tok = rng.choice(self.filler, L + 1)  # [L+1]
    if self.fused:  # one token per pair, at n distinct places
      tok[rng.choice(c, n, replace=False)] = self.pair_ids[ki, vi]
    else:  # key then value, in non-overlapping 2-token slots; pair j at slot order[j]
      starts = (np.sort(rng.choice(c - n, n, replace=False)) + np.arange(n))[rng.permutation(n)]
      tok[starts], tok[starts + 1] = keys, values
    asked = rng.choice(n, q, replace=False)  # [q] distinct pairs, random order
    tok[c::2], tok[c + 1::2] = keys[asked], values[asked]
    weights = np.zeros(L, np.float32)
    weights[c::2] = 1.0  # input = a queried key, target = its value
    return {
        "inputs": tok[:L].astype(np.int32),
        "targets": tok[1:].astype(np.int32),
        "segment_ids": np.ones(L, np.int32),
        "positions": np.arange(L, dtype=np.int32),
        "weights": weights,
    }

  def context_length(self, L: int) -> int:
    """Filler-and-pairs tokens before the queries; the stream is L + 1 long (inputs [:L], targets [1:])."""
    return L + 1 - 2 * self.queries

  def pair_positions(self, inputs: np.ndarray) -> np.ndarray:
    """inputs [..., L] of this task's rows -> [..., L] int: at each query (weights 1), the context
    position of the pair it asks for (the pair token, or with two-token pairs the value), else -1."""
    L = inputs.shape[-1]
    c = self.context_length(L)
    out = np.full(inputs.shape, -1, np.int64)
    ctx = inputs[..., :c]  # [..., c]
    key_of = np.full(self.vocab_size, -1, np.int64)  # token id -> the key of the pair it opens, else -1
    if self.fused:
      key_of[self.pair_ids] = self.keys[:, None]
    else:
      key_of[self.keys] = self.keys
    key_of = key_of[ctx]  # [..., c]
    shift = 0 if self.fused else 1  # two-token pairs: the value follows its key
    for i in range(c, L, 2):
      match = key_of == inputs[..., i:i + 1]  # [..., c]: exactly one place per row
      out[..., i] = np.argmax(match, axis=-1) + shift
    return out


SYNTHETIC_TASKS = {"synthetic": SyntheticBatches, "synthetic_retrieval": RetrievalBatches}
RETRIEVAL_KEYS = ("retrieval_pairs", "retrieval_queries", "retrieval_keys", "retrieval_values", "retrieval_pair_tokens")


class FileBatches(_Batches):
  """Consecutive packed rows: batch n holds global rows [n * B, (n + 1) * B)."""

  def __init__(self, corpus: PackedCorpus, global_batch_size: int, process_index: int, process_count: int):
    super().__init__(global_batch_size, process_index, process_count)
    self.corpus = corpus

  def row(self, step: int, b: int) -> dict[str, np.ndarray]:
    return self.corpus.row(step * self.global_batch_size + b)


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer, *, add_bos: bool, add_eos: bool,
                       chunk: int = 4096) -> list[list[int]]:
  out = []
  bos, eos = [tokenizer.bos_id] * add_bos, [tokenizer.eos_id] * add_eos
  for i in range(0, len(docs), chunk):
    out.extend(bos + ids + eos for ids in tokenizer.encode_batch(docs[i:i + chunk]))
  return out


def build_file_corpus(config: Config, tokenizer: Tokenizer, *, shuffle: bool = True,
                      path: str | None = None) -> tuple[PackedCorpus, ReadReport]:
  """path: dataset_path unless given (eval_dataset_path)."""
  path = config.dataset_path if path is None else path
  if tokenizer.vocab_size > config.vocab_size:
    raise DataError(f"the tokenizer at tokenizer_path='{tokenizer.path}' has {tokenizer.vocab_size} tokens but "
                    f"vocab_size={config.vocab_size}; set vocab_size >= {tokenizer.vocab_size}")
  masks = None
  if config.use_sft:  # conversations: ids and loss weights per token (sft.py)
    records, report = read_jsonl_records(path)
    encode = ConversationEncoder.from_config(config, tokenizer)
    pairs = [d for d in (encode(record, where) for where, record in records) if d is not None]
    if encode.cut or encode.dropped:
      log.warning("dataset_path=%s: %s", path, encode.too_long_note())
    kept, masks = [ids for ids, _ in pairs], [mask for _, mask in pairs]
  else:
    docs, report = read_documents(path, config.jsonl_text_field)
    ids = tokenize_documents(docs, tokenizer, add_bos=config.add_bos, add_eos=config.add_eos)
    kept = [d for d in ids if d]
    report.empty_documents += len(ids) - len(kept)  # only possible with add_bos=add_eos=false
  report.documents = len(kept)
  if not kept:
    raise DataError(f"'{path}' holds no tokens ({report.summary()})")
  corpus = PackedCorpus(kept, seq_len=config.max_target_length, pad_id=config.pad_id, seed=config.seed,
                        shuffle=shuffle, masks=masks, whole=config.use_sft)
  report.tokens = corpus.tokens_per_epoch
  return corpus, report


# ------------------------------------------------------------------------------------- iterator


def _check_step(step: Any) -> int:
  try:
    n = operator.index(step)  # an int, a numpy integer or a 0-d integer array (as a checkpoint may return it)
  except TypeError:
    n = -1
  if isinstance(step, bool) or n < 0:
    raise DataError(f"the data step must be an integer >= 0, got {step!r}")
  return n


class DataIterator(Iterator[dict[str, np.ndarray]]):
  """Batches from a grain MapDataset of batches, with a JSON state that resumes exactly."""

  def __init__(self, source: _Batches, *, dataset_type: str, start_step: int, fingerprint: dict[str, Any],
               num_threads: int, prefetch: int, report: ReadReport | None = None,
               tokenizer: Tokenizer | None = None):
    self.source = source
    self.dataset_type = dataset_type
    self.fingerprint = fingerprint
    self.report = report
    self.tokenizer = tokenizer
    ds = grain.MapDataset.source(source).to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch))
    self._it = iter(ds)
    self._it.set_state({"next_index": _check_step(start_step)})

  @property
  def step(self) -> int:
    """The step of the batch the next `next()` returns."""
    return int(self._it.get_state()["next_index"])

  def __iter__(self) -> DataIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def get_state(self) -> dict[str, Any]:
    return {"dataset_type": self.dataset_type, "step": self.step, **self.fingerprint}

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "step" not in state:
      raise DataError(f"a data state is a dict with a 'step', got {state!r}")
    if state.get("dataset_type") != self.dataset_type:
      raise DataError(f"the data state is of dataset_type={state.get('dataset_type')!r} but this run has "
                      f"dataset_type={self.dataset_type}")
    step = _check_step(state["step"])
    changed = {k: (state.get(k), v) for k, v in self.fingerprint.items() if state.get(k) != v}
    if changed:
      log.warning("resuming data at step %d with a different dataset or batching (was, now): %s; the batches "
                  "that follow are not those the saved run would have seen", step, changed)
    self._it.set_state({"next_index": step})

  def close(self) -> None:
    self._it.close()


def create_data_iterator(config: Config, *, start_step: int = 0, tokenizer: Tokenizer | None = None,
                         process_index: int | None = None, process_count: int | None = None,
                         shuffle: bool = True, num_threads: int = 1,
                         prefetch: int = 2) -> DataIterator | StreamIterator:
  """The batches of steps start_step, start_step + 1, ... for this process.

  process_index / process_count default to jax's; each process gets its contiguous slice of the
  global batch's rows. `tokenizer` reuses a loaded one (else it is loaded from the config).
  """
  if process_index is None or process_count is None:
    import jax
    process_index, process_count = jax.process_index(), jax.process_count()
  if config.global_batch_size % process_count:
    raise DataError(f"global_batch_size={config.global_batch_size} is not divisible by the {process_count} processes")
  if config.dataset_type in ("grain", "hf"):  # streamed shards, packed in lanes (streams.py)
    return create_stream_iterator(config, process_index=process_index, process_count=process_count,
                                  start_step=start_step, tokenizer=tokenizer, prefetch=prefetch)
  common = dict(start_step=start_step, num_threads=num_threads, prefetch=prefetch)
  if config.dataset_type in SYNTHETIC_TASKS:
    source = SYNTHETIC_TASKS[config.dataset_type](config, process_index, process_count)
    fingerprint = {"seed": config.seed, "global_batch_size": config.global_batch_size,
                   "max_target_length": config.max_target_length, "vocab_size": config.vocab_size}
    if config.dataset_type == "synthetic_retrieval":
      fingerprint.update({k: getattr(config, k) for k in RETRIEVAL_KEYS})
    return DataIterator(source, dataset_type=config.dataset_type, fingerprint=fingerprint, **common)
  if config.dataset_type == "file":
    tokenizer = tokenizer or load_tokenizer(config)
    corpus, report = build_file_corpus(config, tokenizer, shuffle=shuffle)
    skipped = report.empty_documents or report.blank_jsonl_lines or report.ignored_files
    log.log(logging.WARNING if skipped else logging.INFO, "dataset_path=%s: %s; %d rows of %d tokens per epoch",
            config.dataset_path, report.summary(), corpus.rows_per_epoch, config.max_target_length)
    source = FileBatches(corpus, config.global_batch_size, process_index, process_count)
    fingerprint = {"seed": config.seed, "global_batch_size": config.global_batch_size,
                   "max_target_length": config.max_target_length, "num_documents": corpus.num_documents,
                   "tokens_per_epoch": corpus.tokens_per_epoch}
    return DataIterator(source, dataset_type="file", fingerprint=fingerprint, report=report, tokenizer=tokenizer,
                        **common)
  raise DataError(f"dataset_type={config.dataset_type!r} is not one of {', '.join(SYNTHETIC_TASKS)}, file, grain, hf")


def create_eval_iterator(config: Config, *, tokenizer: Tokenizer | None = None, process_index: int | None = None,
                         process_count: int | None = None) -> DataIterator | HeldOutBatches:
  """Held-out batches: eval_dataset_path packed like the training files (unshuffled), or for
  synthetic data a stream of its own salt (the same task, rows training never draws); for grain / hf
  data the first eval_steps batches of grain_eval_files / hf_eval_files."""
  if process_index is None or process_count is None:
    import jax
    process_index, process_count = jax.process_index(), jax.process_count()
  if config.dataset_type in ("grain", "hf"):
    return HeldOutBatches(config, process_index=process_index, process_count=process_count, tokenizer=tokenizer)
  common = dict(start_step=0, num_threads=1, prefetch=1, fingerprint={})
  if config.dataset_type in SYNTHETIC_TASKS:
    source = SYNTHETIC_TASKS[config.dataset_type](config, process_index, process_count, salt=_EVAL_SALT)
    return DataIterator(source, dataset_type=config.dataset_type, **common)
  tokenizer = tokenizer or load_tokenizer(config)
  corpus, report = build_file_corpus(config, tokenizer, shuffle=False, path=config.eval_dataset_path)
  source = FileBatches(corpus, config.global_batch_size, process_index, process_count)
  return DataIterator(source, dataset_type="file", report=report, tokenizer=tokenizer, **common)
