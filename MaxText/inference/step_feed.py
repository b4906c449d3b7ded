"""A serving step's host inputs in ONE int32 array [b, 4t + 11 + P] (one host-to-device transfer).

    feed = step_feed.empty(b, t, pages)     # b padding rows of t tokens, a page table of `pages`
    step_feed.fill(feed, rows, where)       # the scheduled rows at their batch rows
    buf = step_feed.to_device(feed)         # [b, W] int32: row i holds all of row i's inputs
    f = step_feed.unpack(buf, t)            # inside the jitted step: the named fields

Row-major, so the array shards over rows as a step's rows do. The named fields of `feed` are views
into it (fp32 fields as their bits). Per row i (a Scheduled row: tokens [start, start + count) of its
request, its last len(drafts) the drafts):
  tokens [b,t]     the row's known tokens then its drafts; 0 past them
  positions [b,t]  start + j (padding continues the count: its writes are dropped anyway)
  write_pos [b,t]  the position each token's cache entry is written at; -1 for padding (dropped)
  next [b,t]       token j + 1 of the row (the MTP layer's input; a prompt chunk's last: the prompt's next)
  last [b]         the row index of its last known token (the logits the request samples from)
  samples [b]      1 when that token's logits give the request its next token(s)
  num_drafts [b]   len(drafts); q_row [b]: its request's row of draft_q (its drafts' distributions; new ones go there)
  top_k [b], temp [b] fp32, top_p [b] fp32, min_p [b] fp32: the request's options; seeds [b]: its seed's low 32 bits (uint32 bits)
  draw_at [b]      the position of the first token this row draws
  adapter [b]      its request's LoRA adapter slot (serve_lora_adapters' entry k is slot k; 0 = the base: layers/lora_rows.py)
  table [b,P]      the request's pages; -1 past them
A padding row (no request) has write_pos -1 everywhere and temperature 0, so it writes and draws nothing.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEQ = ("tokens", "positions", "write_pos", "next")  # [b,t] each
ROW = ("last", "samples", "num_drafts", "q_row", "top_k", "draw_at", "seeds", "temp", "top_p", "min_p",
       "adapter")  # [b] each
FLOAT = ("temp", "top_p", "min_p")  # fp32 bits


def width(t: int, pages: int) -> int:
  """A row's int32 values: its SEQ fields, ROW fields and page table."""
  return len(SEQ) * t + len(ROW) + pages


def _fields(buf, t: int, bits=lambda a: a) -> dict:
  """Named column slices of buf [b, W]; FLOAT fields through `bits` (their int32 bits -> fp32)."""
  f = {name: buf[:, i * t:(i + 1) * t] for i, name in enumerate(SEQ)}
  base = len(SEQ) * t
  f |= {name: buf[:, base + i] if name not in FLOAT else bits(buf[:, base + i:base + i + 1])[:, 0]
        for i, name in enumerate(ROW)}
  return f | {"table": buf[:, base + len(ROW):]}


def empty(b: int, t: int, pages: int) -> dict:
  """b padding rows of t tokens over a page table of `pages`: the named fields (views) and "buf"."""
  buf = np.zeros((b, width(t, pages)), np.int32)
  f = _fields(buf, t, bits=lambda a: a.view(np.float32))
  f["positions"][:] = np.arange(t, dtype=np.int32)
  f["write_pos"][:] = -1  # padding: its writes are dropped
  f["table"][:] = -1
  f["top_p"][:] = 1.0
  return f | {"buf": buf, "t": t}


def fill(feed: dict, rows: Sequence, where: Sequence[int]) -> None:
  """Writes each Scheduled row at its batch row where[i] (the step's t must hold its count)."""
  t = feed["t"]
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
    feed["temp"][i], feed["top_p"][i], feed["top_k"][i], feed["min_p"][i] = p.temperature, p.top_p, p.top_k, p.min_p
    feed["seeds"][i] = np.uint32((p.seed or 0) % 2 ** 32).view(np.int32)
    feed["draw_at"][i] = row.start + known
    feed["adapter"][i] = p.lora_adapter


def to_device(feed: dict) -> jax.Array:
  """The step's inputs on the device: one transfer."""
  return jnp.asarray(feed["buf"])


def unpack(buf: jax.Array, t: int) -> dict:
  """Inside a jitted step: buf [b, W] -> the named fields (samples bool, seeds uint32, temp/top_p/min_p fp32)."""
  f = _fields(buf, t, bits=lambda a: jax.lax.bitcast_convert_type(a, jnp.float32))
  f["samples"] = f["samples"] > 0
  f["seeds"] = jax.lax.bitcast_convert_type(f["seeds"], jnp.uint32)
  return f


def abstract(b: int, t: int, pages: int, sharding=None) -> jax.ShapeDtypeStruct:
  """The step's input as a ShapeDtypeStruct (sharding: the rows', or None)."""
  return jax.ShapeDtypeStruct((b, width(t, pages)), jnp.int32, sharding=sharding)


__all__ = ["SEQ", "ROW", "empty", "fill", "to_device", "unpack", "abstract", "width"]
