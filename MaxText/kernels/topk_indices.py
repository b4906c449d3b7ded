"""The indexer's selection as indices, and the rows they pick: what gather-based attention reads.

`topk_indices` turns scores [..., s] into k index slots per query (the same sets as the masks of
selection.py: exact = lax.top_k's set, ties lowest position first; approx = select_topk's);
`mask_to_indices` compacts any selection mask; `gather_rows` reads the selected rows of a
[b,s,e] array (a latent cache, indexer keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.kernels import backend
from MaxText.kernels.selection import generate_mask, select_topk, topk_threshold

_WORD = 32  # mask bits packed per uint32 word when compacting a mask to indices


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [b,s,e], idx [b,t,k] int32 in [0, s) -> x[b, idx] [b,t,k,e] (a batched gather of rows)."""
  return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0, mode="clip"))(x, idx)  # [b,t,k,e]


def _cumsum_last(x: jax.Array) -> jax.Array:
  """Inclusive prefix sum over the last axis (a log-depth scan: XLA:CPU's cumsum is a slow
  reduce-window)."""
  return lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def _nth_set_bit(word: jax.Array, n: jax.Array) -> jax.Array:
  """Position (0..31) of the n-th (0-based) set bit of each uint32 word; n < popcount(word)."""
  pos = jnp.zeros(word.shape, jnp.int32)
  for width in (16, 8, 4, 2, 1):  # halve the window that holds the bit
    low = word & jnp.uint32((1 << width) - 1)
    below = lax.population_count(low).astype(jnp.int32)
    up = n >= below
    n = jnp.where(up, n - below, n)
    pos = jnp.where(up, pos + width, pos)
    word = jnp.where(up, word >> width, low)
  return pos


def _place_by_compare(incl: jax.Array, words: jax.Array, slots: jax.Array) -> tuple[jax.Array, ...]:
  """mask_to_indices' placement with no search and no gather (backend.py index_placement "compare":
  on a TPU the binary search is a while loop of 1-D gathers, 8.5 ms for 16 rows of 128K keys):
  incl [..., L] the words' inclusive prefix counts, words [..., L], slots [k] -> (word_of, before,
  word) [..., k]: slot j lies in the word_of-th word = #{l: incl[l] <= j} (incl is nondecreasing), after
  before = max{incl[l] <= j} (0 if none) selected keys, and that word's bits. Three fused
  compare-reductions over [..., k, L] (O(k L) work, no [..., k, L] buffer once fused)."""
  le = incl[..., None, :] <= slots[:, None]  # [..., k, L]
  last = incl.shape[-1] - 1
  word_of = jnp.minimum(jnp.sum(le, axis=-1, dtype=jnp.int32), last)  # [..., k]
  before = jnp.max(jnp.where(le, incl[..., None, :], 0), axis=-1)  # [..., k]
  at = jnp.arange(incl.shape[-1], dtype=jnp.int32) == word_of[..., None]  # [..., k, L]: one-hot of word_of
  word = jnp.sum(jnp.where(at, words[..., None, :], jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # [..., k]
  return word_of, before, word


def onehot_rows(table: jax.Array, idx: jax.Array) -> jax.Array:
  """table [..., G, c] int32, idx [..., m] in [0, G) -> table[..., idx, :] [..., m, c], exactly, with no gather: a
  one-hot [..., m, G] (bf16) dot with the values' four bytes (bf16, each exact) accumulated in fp32, one nonzero
  product a sum, so every int32 comes back bit for bit. On a TPU a gather costs ~10 ns an index whatever its
  row's width (paged_cache.lookup_pages, docs/kernels.md); this is O(m G c) MXU work instead."""
  lead, (g, c), m = table.shape[:-2], table.shape[-2:], idx.shape[-1]
  shifts = (0, 8, 16, 24)
  parts = jnp.stack([(table >> s) & 0xFF for s in shifts], axis=-1).astype(jnp.bfloat16)  # [..., G, c, 4] bytes
  hot = (idx[..., None] == jnp.arange(g, dtype=idx.dtype)).astype(jnp.bfloat16)  # [..., m, G]
  got = jnp.einsum("...mg,...gk->...mk", hot, parts.reshape(*lead, g, c * 4),
                   preferred_element_type=jnp.float32).astype(jnp.int32)  # [..., m, c*4]
  got = got.reshape(*lead, m, c, 4)
  return sum(got[..., i] << s for i, s in enumerate(shifts))  # [..., m, c]


GROUP_WORDS = 16  # _place_by_groups' words a group (512 keys). The 16-row 128K step compiled for a v5e
# (decode_profile --compile-for), XLA's estimate of the selection: 8 / 16 / 32 / 64 words 1.045 / 0.999 / 1.092 /
# 1.375 ms (the one-hot rows' output, k x (2g+1) x 4 values, grows with g; the group compare, k x L/g, shrinks)


def _place_by_groups(incl: jax.Array, words: jax.Array, slots: jax.Array) -> tuple[jax.Array, ...]:
  """_place_by_compare's (word_of, before, word) [..., k] in two levels (backend.py index_placement "grouped"):
  the L words in G groups of g = GROUP_WORDS; slot j's group = #{groups whose last prefix count <= j}
  (a compare over [..., k, G]), that group's g prefix counts and words and the count before it taken by
  onehot_rows (no gather), then the word within it = #{its counts <= j} (a compare over [..., k, g]).
  O(k (G + g)) compares a row, against O(k L) for "compare": at L = 4096 words (128K keys) 256 + 16 a slot, not
  4096. The same word_of and before for every slot, and the same word for every slot < the row's count (past it
  mask_to_indices gives 0 whatever the word)."""
  L = incl.shape[-1]
  g = min(GROUP_WORDS, L)  # words a group
  n = -(-L // g)  # groups
  pad = [(0, 0)] * (incl.ndim - 1) + [(0, n * g - L)]
  incl_g = jnp.pad(incl, pad, mode="edge").reshape(*incl.shape[:-1], n, g)  # [..., G, g] (nondecreasing)
  words_g = jnp.pad(jax.lax.bitcast_convert_type(words, jnp.int32), pad).reshape(*incl.shape[:-1], n, g)
  ends = incl_g[..., -1]  # [..., G] the count through each group
  prev = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)  # [..., G] the count before it
  grp = jnp.minimum(jnp.sum(ends[..., None, :] <= slots[:, None], axis=-1, dtype=jnp.int32), n - 1)  # [..., k]
  rows = onehot_rows(jnp.concatenate([incl_g, words_g, prev[..., None]], axis=-1), grp)  # [..., k, 2g+1]
  incl_r, words_r, prev_r = rows[..., :g], rows[..., g:2 * g], rows[..., 2 * g]
  le = incl_r <= slots[:, None]  # [..., k, g]
  within = jnp.sum(le, axis=-1, dtype=jnp.int32)  # [..., k] words of the group at or below the slot
  word_of = jnp.minimum(grp * g + within, L - 1)
  before = jnp.maximum(prev_r, jnp.max(jnp.where(le, incl_r, 0), axis=-1))  # [..., k]
  at = jnp.arange(g, dtype=jnp.int32) == within[..., None]  # [..., k, g]
  word = jnp.sum(jnp.where(at, words_r, 0), axis=-1, dtype=jnp.int32)  # [..., k]
  return word_of, before, jax.lax.bitcast_convert_type(word, jnp.uint32)


def mask_to_indices(mask: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """A selection mask [..., s] with at most k True per row -> (idx [..., k] int32: the selected
  positions ascending, then 0; idx_valid [..., k] bool: slot < the row's count).

  O(s) per row for packing the mask into 32-bit words and counting, O(k log s) for placing the
  slots (a binary search over the words' prefix counts, then the n-th set bit of one word): no
  scatter and no [s]-long prefix sum, which are slow on XLA:CPU. On a TPU (backend.py
  index_placement "compare") the slots are placed by counting instead (_place_by_compare), or ("grouped") by
  counting in two levels (_place_by_groups): the same indices.
  """
  s = mask.shape[-1]
  pad = -s % _WORD
  m = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)]) if pad else mask
  m = m.reshape(*mask.shape[:-1], -1, _WORD)  # [..., L, 32]
  bit = jnp.left_shift(jnp.uint32(1), jnp.arange(_WORD, dtype=jnp.uint32))  # [32]
  words = jnp.sum(jnp.where(m, bit, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # [..., L] (distinct bits: sum = or)
  count = lax.population_count(words).astype(jnp.int32)  # [..., L]
  incl = _cumsum_last(count)  # [..., L]
  slots = jnp.arange(k, dtype=jnp.int32)  # [k]
  placement = backend.choice("index_placement")
  if placement == "compare":
    word_of, before, word = _place_by_compare(incl, words, slots)
  elif placement == "grouped":
    word_of, before, word = _place_by_groups(incl, words, slots)
  else:
    flat_incl = incl.reshape(-1, incl.shape[-1])  # [N, L]
    word_of = jax.vmap(lambda row: jnp.searchsorted(row, slots, side="right"))(flat_incl)  # [N, k]
    word_of = jnp.minimum(word_of, incl.shape[-1] - 1).reshape(*mask.shape[:-1], k).astype(jnp.int32)
    before = jnp.take_along_axis(incl - count, word_of, axis=-1)  # [..., k] selected keys in earlier words
    word = jnp.take_along_axis(words, word_of, axis=-1)  # [..., k]
  bit_pos = _nth_set_bit(word, slots - before)  # [..., k]
  valid = slots < incl[..., -1:]  # [..., k]
  idx = jnp.where(valid, word_of * _WORD + bit_pos, 0)
  return idx.astype(jnp.int32), valid


def topk_indices(scores: jax.Array, k: int, *, approx: bool = False,
                 recall_target: float = 0.95) -> tuple[jax.Array, jax.Array]:
  """The indexer's selection as indices: scores [..., s] (-inf where not valid) -> (idx [..., k']
  int32, idx_valid [..., k'] bool), k' = min(k, s).

  exact: the set of selection.generate_mask(exact_topk=True) (= lax.top_k's: exactly
  min(k', #finite) keys, ties lowest position first), ascending, then 0 in invalid slots.
  exact_selection "binned" (CPU; backend.py): compacted from the mask of the fast k-th value;
  "top_k": lax.top_k's indices, sorted.
  approx: selection.select_topk(approx=True)'s indices, a slot valid where its score is finite.
  A -inf or NaN score is never a valid slot.
  """
  kk = min(k, scores.shape[-1])
  if approx:
    values, idx = select_topk(scores, kk, approx=True, recall_target=recall_target)
    return idx.astype(jnp.int32), values > -jnp.inf  # select_topk reads NaN as -inf
  if backend.choice("exact_selection") == "top_k":
    values, idx = select_topk(scores, kk)  # [..., k'] x2, NaN read as -inf
    s = scores.shape[-1]
    idx = jnp.sort(jnp.where(values > -jnp.inf, idx, s), axis=-1)  # ascending, invalid slots (s) last
    return jnp.where(idx < s, idx, 0).astype(jnp.int32), idx < s
  mask = generate_mask(scores, topk_threshold(scores, kk), exact_topk=True, k=kk)  # [..., s]
  return mask_to_indices(mask, kk)
