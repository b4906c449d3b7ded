"""A serving step's host inputs, packed in four arrays (four host-to-device transfers a step).

    feed = step_feed.empty(b, t, pages_per_seq)   # b padding rows of t tokens
    step_feed.fill(feed, rows, where)             # the scheduled rows at their batch rows
    packed = feed["packed"]                        # (seq [4,b,t] i32, row [7,b] i32, opt [2,b] f32, table [b,P] i32)
    f = step_feed.unpack(packed)                   # inside the jitted step: the named fields

The named fields of `feed` are views into the packed arrays. Per row i (a Scheduled row: tokens
[start, start + count) of its request, its last len(drafts) the drafts):
  tokens [b,t]     the row's known tokens then its drafts; 0 past them
  positions [b,t]  start + j (padding continues the count: its writes are dropped anyway)
  write_pos [b,t]  the position each token's cache entry is written at; -1 for padding (dropped)
  next [b,t]       token j + 1 of the row (the MTP layer's input; a prompt chunk's last: the prompt's next)
  last [b]         the row index of its last known token (the logits the request samples from)
  samples [b]      1 when that token's logits give the request its next token(s)
  num_drafts [b]   len(drafts); q_row [b]: the batch row its drafts' distributions were made at
  top_k, temp, top_p [b]  the request's options; seeds [b]: its seed's low 32 bits (uint32 bits as int32)
  draw_at [b]      the position of the first token this row draws
  table [b,P]      the request's pages; -1 past them
A padding row (no request) has write_pos -1 everywhere and temperature 0, so it writes and draws nothing.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEQ = ("tokens", "positions", "write_pos", "next")  # [b,t] int32
ROW = ("last", "samples", "num_drafts", "q_row", "top_k", "draw_at", "seeds")  # [b] int32
OPT = ("temp", "top_p")  # [b] fp32


def empty(b: int, t: int, pages_per_seq: int) -> dict:
  """b padding rows of t tokens: the named fields (views) and "packed", the four arrays."""
  seq, row = np.zeros((len(SEQ), b, t), np.int32), np.zeros((len(ROW), b), np.int32)
  opt, table = np.ones((len(OPT), b), np.float32), np.full((b, pages_per_seq), -1, np.int32)
  seq[SEQ.index("positions")] = np.arange(t, dtype=np.int32)
  seq[SEQ.index("write_pos")] = -1  # padding: its writes are dropped
  opt[OPT.index("temp")] = 0.0
  f = {name: seq[i] for i, name in enumerate(SEQ)} | {name: row[i] for i, name in enumerate(ROW)}
  return f | {name: opt[i] for i, name in enumerate(OPT)} | {"table": table, "packed": (seq, row, opt, table)}


def fill(feed: dict, rows: Sequence, where: Sequence[int]) -> None:
  """Writes each Scheduled row at its batch row where[i] (the step's t must hold its count)."""
  t = feed["tokens"].shape[1]
  for i, row in zip(where, rows):
    r, n, known = row.request, row.count, row.known
    feed["tokens"][i, :n] = r.tokens[row.start:row.start + known] + list(row.drafts)
    feed["positions"][i] = row.start + np.arange(t)
    feed["write_pos"][i, :n] = feed["positions"][i, :n]
    feed["next"][i, :n - 1] = feed["tokens"][i, 1:n]  # token j + 1 within the row
    if not row.samples:
      feed["next"][i, n - 1] = r.tokens[row.start + n]  # a prompt chunk's next token is known
    feed["table"][i, :len(r.pages)] = r.pages
    feed["last"][i], feed["samples"][i], feed["num_drafts"][i] = known - 1, row.samples, len(row.drafts)
    feed["q_row"][i] = r.draft_row
    p = r.params
    feed["temp"][i], feed["top_p"][i], feed["top_k"][i] = p.temperature, p.top_p, p.top_k
    feed["seeds"][i] = np.uint32((p.seed or 0) % 2 ** 32).view(np.int32)
    feed["draw_at"][i] = row.start + known


def to_device(feed: dict) -> tuple:
  """The packed arrays on the device (four transfers)."""
  return tuple(jnp.asarray(a) for a in feed["packed"])


def unpack(packed: tuple) -> dict:
  """Inside a jitted step: packed -> the named fields (samples bool, seeds uint32)."""
  seq, row, opt, table = packed
  f = {name: seq[i] for i, name in enumerate(SEQ)} | {name: row[i] for i, name in enumerate(ROW)}
  f |= {name: opt[i] for i, name in enumerate(OPT)} | {"table": table}
  f["samples"] = f["samples"] > 0
  f["seeds"] = jax.lax.bitcast_convert_type(f["seeds"], jnp.uint32)
  return f


def abstract(b: int, t: int, pages_per_seq: int, sharding=None) -> tuple:
  """The packed arrays as ShapeDtypeStructs; sharding(ndim, lead) gives each its rows' sharding
  (lead: the leading field axes before the row axis)."""
  shape = lambda *s, dtype=jnp.int32, lead=1: jax.ShapeDtypeStruct(  # noqa: E731
      s, dtype, sharding=None if sharding is None else sharding(len(s), lead))
  return (shape(len(SEQ), b, t), shape(len(ROW), b), shape(len(OPT), b, dtype=jnp.float32),
          shape(b, pages_per_seq, lead=0))


__all__ = ["SEQ", "ROW", "OPT", "empty", "fill", "to_device", "unpack", "abstract"]
