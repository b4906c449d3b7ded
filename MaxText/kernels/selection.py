"""Top-k selection for the lightning indexer (DeepSeek Sparse Attention): pure functions.

Scores are [..., s] (typically [b,t,s], -inf where a key is not valid); every function works
row by row over the last axis and takes only arrays and static Python arguments (jit-able,
vmappable, no config). NaN scores are treated as -inf everywhere, and a -inf or NaN score is
never selected ahead of a finite one. k' = min(k, s) throughout.

Which method runs where (each backend's choice: backend.py; exact_selection, approx_selection,
row_blocks):
  select_topk(approx=False)  jax.lax.top_k, every backend (sorted, exact).
  select_topk(approx=True)   "approx_max_k" (the portable choice): jax.lax.approx_max_k (on CPU and
                             GPU an exact sort-based fallback). "binned" (CPU): our binned method
                             (_binned_topk_block).
  topk_threshold             "binned" (CPU): the exact k-th value from bounds on strided bins closed
                             by bisection over order-preserving int32 keys (_threshold_block).
                             "top_k": lax.top_k's last value.
  generate_mask              one compare against the cutoff (+ a tie fix only when needed).
  topk_mask                  "binned": topk_threshold + generate_mask fused: each block of rows
                             reads its scores once (they no longer fit the last-level cache at
                             s=131072); exact k: a fast path checked per row, failed rows redone
                             in full (_topk_mask_checked). "top_k": lax.top_k's indices scattered.
                             approx=True: select_topk(approx)'s set; "binned" for k >= s/128
                             writes its mask per block, checked per row, rows with ties at the
                             k-th redone (_binned_mask_checked).
  generate_mask_reference    the original all-pairs index compare: the oracle for tests.

Why not lax.top_k for everything on CPU: there it costs ~O(s log k) per row with a large constant,
and the mask path needs only each row's k-th value (benchmarks/indexer_topk.py compares them).
With row_blocks="cache" (CPU) the row-wise work runs in blocks of rows small enough to stay in
the L2 cache (_map_blocks); "all" takes all rows at once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.kernels import backend, kth_value
from MaxText.kernels.selection_keys import (
  _IMAX,
  _IMIN,
  _NEG_INF_KEY,
  Columns,
  _count_ge,
  _exclusive_cumsum,
  _from_keys,
  _kth_key,
  _map_blocks,
  _pad_last,
  _repair_rows,
  _sanitize,
  _to_keys,
)

# ----------------------------------------------------------------------------- the k-th value


def topk_threshold(scores: jax.Array, k: int) -> jax.Array:
  """scores [..., s] -> [..., 1]: each row's k'-th largest value, exactly as
  lax.top_k(scores, k')[0][..., -1:] with NaN read as -inf (-inf when fewer than k' are finite).

  exact_selection "binned" (CPU): no sort and no top_k: bounds from the top of strided bins,
  closed by bisection over int32 keys (_threshold_block), in blocks of rows (row_blocks). Under
  vmap its lax.conds become selects: still exact, but the rare branches are then always computed.
  "top_k" (portable): lax.top_k's last value.
  """
  if k < 1:
    raise ValueError(f"topk_threshold: k must be >= 1, got {k}")
  kk = min(k, scores.shape[-1])
  chosen = backend.choice("exact_selection")
  if chosen == "top_k":
    return lax.top_k(_sanitize(scores), kk)[0][..., -1:]
  if chosen == "pallas":
    return kth_value.kth_largest(scores, kk)
  return _map_blocks(lambda x: _threshold_block(x, kk), scores)


def _bin_levels(keys: jax.Array, m: int, above=None) -> jax.Array:
  """keys [R,B,L] (strided bins of B <= 16 keys) -> [R,m,L]: the m largest distinct keys of each bin, or
  with `above` [R] the m smallest distinct keys > above. One max (min) pass per level (a chain
  of elementwise max/min down the 16 rows, or a multiset top 2, slower on XLA:CPU: docs/measured_choices.md)."""
  levels, prev = [], None if above is None else above[:, None, None]
  for _ in range(m):
    if above is None:
      live = keys if prev is None else jnp.where(keys < prev, keys, _IMIN)
      prev = jnp.max(live, axis=1, keepdims=True)  # [R,1,L]
    else:
      prev = jnp.min(jnp.where(keys > prev, keys, _IMAX), axis=1, keepdims=True)
    levels.append(prev)
  return jnp.concatenate(levels, axis=1)


def _fold(cand: jax.Array, m: int) -> jax.Array:
  """cand [R,n] -> [R, m*ceil(n/16)]: the m largest distinct entries of each strided bin of 16
  entries; a subset (so its k-th is a bound) small enough to make a bisection over it cheap."""
  return _bin_levels(_pad_last(cand, 16, _IMIN).reshape(cand.shape[0], 16, -1), m).reshape(cand.shape[0], -1)


def _keys_missed(s: int, k: int) -> float:
  """The expected number of a random row's top k keys that lo's bins (16 keys, top 2) miss."""
  return (1.0 - binned_recall(s - s % 16, k, 16, 2)) * k


def _one_level_closes(s: int, k: int, rows: int) -> bool:
  """Whether hi from each bin's single smallest key above lo (see _threshold_keys) is likely to
  close a block of `rows` rows: it fails where a bin holds 2 of the r smallest keys above lo, with
  r ~ the keys the top-2 bins lose (the recall estimate of 16-key bins keeping 2)."""
  if s < 32 * 16 or k > s // 8:
    return False
  r = 1 + _keys_missed(s, k)
  return rows * (s // 16) * 120 * (r / s) ** 2 < 0.05  # 120 = C(16, 2) pairs per bin


def _threshold_keys(keys: jax.Array, k: int, count: bool = False) -> tuple[jax.Array, jax.Array]:
  """keys [R,16,L] -> (kth [R], n_ge [R]): each row's exact k-th largest key and, with count,
  #(keys >= kth) (for the mask's tie check; counted once whichever way kth was found),
  2.2x (k=2048) to 3.6x (k=64) faster on CPU than a bisection over all keys (32 passes).
  With L = s/16 strided bins of 16 keys:

  lo: the k-th largest of each bin's top 2 keys (the second keys folded to the top 3 of each 16
    bins (_fold) when that leaves k). A subset's k-th is never above the row's, and is equal
    unless some bin holds 3+ of the top k (then c = #keys > lo >= k).
  hi: the r-th smallest key above lo, r = c - k + 1 (r - 1 = the keys the bins missed, about
    L*E[(N-2)+]: ~67 at k=2048, s=65536), from each bin's 2 smallest keys above lo: a subset
    again, so hi >= the k-th, and #keys >= hi being >= k proves hi <= the k-th too. Where that
    fails (a bin holding 3 of those r keys, ~3e-3 of rows at k=2048; heavy ties; adversarial
    rows with the top keys in one bin) the block falls back to the bisection over all keys.
    Where r is small (_one_level_closes: s=131072, k=2048 has r ~ 17) hi is first tried from each
    bin's single smallest key above lo, folded (_fold) to 2 per 16 bins: one pass over the keys
    and a bisection over 2L/16 instead of two passes and one over 2L; the 2-key hi runs only in
    the blocks where that proof fails (~2% of rows there).
  Each k-th of a candidate set is a 32-pass bisection over it (_kth_key). 2 levels for lo and
  for hi, the folds and the 1-level-first hi are the fastest measured (docs/measured_choices.md,
  benchmarks/indexer_topk.py).
  """
  r = keys.shape[0]
  kth = jax.vmap(_kth_key)
  k_rows = jnp.full((r,), k, jnp.int32)
  with_count = lambda tau: (tau, _count_ge(keys, tau) if count else jnp.zeros_like(tau))

  def exact(_):  # 32 passes over all keys
    return with_count(kth(keys.reshape(r, -1), k_rows))

  if 2 * keys.shape[-1] < k:  # too few candidates: k close to s
    return exact(None)
  lo, c = _lo_key(keys, k)

  def close_with(levels, otherwise):
    tau = _hi_key(keys, k, lo, c, levels)
    n_ge = _count_ge(keys, tau)  # proves hi <= the k-th where c >= k (lo is exact elsewhere)
    return lax.cond(jnp.all((c < k) | (n_ge >= k)), lambda _: (tau, n_ge), otherwise, None)

  close = lambda _: close_with(2, exact)
  first = (lambda _: close_with(1, close)) if _one_level_closes(16 * keys.shape[-1], k, r) else close
  return lax.cond(jnp.any(c >= k), first, lambda _: with_count(lo), None)


def _lo_key(keys: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """keys [R,16,L] -> (lo [R], c [R]): _threshold_keys' lower bound and #keys > lo. Needs 2L >= k."""
  r, n_bins = keys.shape[0], keys.shape[-1]
  top2 = _bin_levels(keys, 2)  # [R,2,L]
  if n_bins + 3 * -(-n_bins // 16) >= k:  # the second keys folded: fewer candidates, the same bound but rarely
    cand = jnp.concatenate([top2[:, 0], _fold(top2[:, 1], 3)], axis=1)  # [R, L + 3L/16]
  else:
    cand = top2.reshape(r, -1)  # [R,2L]
  lo = jax.vmap(_kth_key)(cand, jnp.full((r,), k, jnp.int32))  # [R]
  return lo, jnp.where(lo == _IMAX, 0, _count_ge(keys, lo + 1))  # none above the top key


def _hi_key(keys: jax.Array, k: int, lo: jax.Array, c: jax.Array, levels: int) -> jax.Array:
  """[R]: where c >= k, the r-th smallest key above lo (r = c - k + 1) among each bin's `levels`
  (1 or 2) smallest keys above lo (1: folded to 2 per 16 bins), an upper bound of the k-th
  (_threshold_keys' hi); elsewhere lo."""
  r = keys.shape[0]
  if levels == 1:
    low = ~_fold(~_bin_levels(keys, 1, above=lo)[:, 0], 2)  # [R,2L/16]; IMAX = none
  else:
    low = _bin_levels(keys, 2, above=lo).reshape(r, -1)  # [R,2L]
  hi = ~jax.vmap(_kth_key)(~low, jnp.where(c >= k, c - k + 1, 1))  # ~ reverses the order: r-th smallest
  return jnp.where(c >= k, hi, lo)


def _threshold_block(x: jax.Array, k: int) -> jax.Array:
  """x [R,s] -> [R,1], the exact k-th value of each row (see _threshold_keys)."""
  r = x.shape[0]
  keys = _pad_last(_to_keys(x), 16, _IMIN).reshape(r, 16, -1)  # [R,16,L]: key of position g*L + l
  return _from_keys(_threshold_keys(keys, k)[0])[:, None]


def topk_mask(scores: jax.Array, k: int, *, exact_topk: bool = True, approx: bool = False,
              recall_target: float = 0.95) -> jax.Array:
  """bool [..., s], True = attend: generate_mask(scores, topk_threshold(scores, k), exact_topk, k)
  in one pass over the scores. exact_selection "binned" (CPU): each cache-resident block of rows
  finds its k-th values and writes its mask while its keys are still in cache (the two calls read
  every score twice, from memory once the scores outgrow the last-level cache, e.g.
  f32[1,1024,131072] = 512 MiB). "top_k": lax.top_k's indices scattered (exact_topk), or its
  k-th value as the cutoff.

  approx=True: the mask of select_topk(approx=True, recall_target)'s selection, the same set:
  with exact_topk its index set minus -inf/NaN scores (approx_selection "binned" and k >= s/128:
  written per block with no indices, _binned_mask_checked), else every key >= its smallest value.
  """
  if k < 1 or not 0.0 < recall_target <= 1.0:
    raise ValueError(f"topk_mask: need k >= 1 and 0 < recall_target <= 1, got k={k}, "
                     f"recall_target={recall_target}")
  kk = min(k, scores.shape[-1])
  chosen = backend.choices()
  binned = approx and chosen.approx_selection == "binned"
  config = binned_config(scores.shape[-1], kk, recall_target) if binned else None
  # Writing the mask per block costs more than a scatter of few indices: it pays from k >= s/128
  # (docs/measured_choices.md; benchmarks/indexer_topk.py).
  if config is not None and exact_topk and 128 * kk >= scores.shape[-1]:
    return _binned_mask_checked(scores, kk, *config)
  if approx and (not binned or config is not None):
    values, indices = select_topk(scores, kk, approx=True, recall_target=recall_target)
    return generate_mask(scores, values, indices if exact_topk else None, exact_topk=exact_topk, k=kk)
  # Exact; also a binned approx where no binning pays (select_topk is then lax.top_k: this set).
  if chosen.exact_selection == "top_k":
    values, indices = select_topk(scores, kk)
    return generate_mask(scores, values, indices if exact_topk else None, exact_topk=exact_topk, k=kk)
  if chosen.exact_selection == "pallas":
    return generate_mask(scores, topk_threshold(scores, kk), exact_topk=exact_topk, k=kk)
  if exact_topk and 2 * -(-scores.shape[-1] // 16) >= kk:
    return _topk_mask_checked(scores, kk)
  return _map_blocks(lambda x: _topk_mask_block(x, kk, exact_topk), scores)


def _topk_mask_checked(scores: jax.Array, k: int) -> jax.Array:
  """topk_mask(exact_topk=True) as a fast path with no lax.cond, then a repair of the rows it
  could not prove. A lax.cond in a block makes XLA:CPU write the block's keys out as the branch
  operand (recomputed from the scores in every pass otherwise), a cost measured in
  docs/measured_choices.md.

  Fast path per block (_checked_mask_block): a bound tau on the k-th, the mask keys >= tau, and
  the check that it holds exactly k keys (exactly the top k, whatever tau's derivation; or, with
  tau <= -inf, at most k finite keys: all of them). Rows failing it (a bound that missed, ties at
  the k-th) are redone, a block of rows at a time, by _topk_mask_block (bounds, fallbacks, ties).
  """
  mask, bad = _map_blocks(lambda x: _checked_mask_block(x, k), scores)  # [..., s], [...]
  return _repair_rows(scores, mask, bad, lambda x: _topk_mask_block(x, k, True))


def _checked_mask_block(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """x [R,s] -> (mask [R,s], bad [R]): see _topk_mask_checked. tau: lo alone where lo's bins
  rarely miss keys (_keys_missed), else hi from 1 or 2 keys per bin (_hi_key)."""
  r, s = x.shape
  keys = _pad_last(_to_keys(x), 16, _IMIN).reshape(r, 16, -1)  # [R,16,L]: key of position g*L + l
  tau, c = _lo_key(keys, k)  # [R] x2 (c is dead code, dropped by XLA, where lo alone is used)
  if _keys_missed(16 * keys.shape[-1], k) >= 0.05:
    tau = _hi_key(keys, k, tau, c, 1 if _one_level_closes(16 * keys.shape[-1], k, r) else 2)
  floor = jnp.maximum(tau, _NEG_INF_KEY + 1)  # [R]: never -inf/NaN
  n_ge = _count_ge(keys, floor)
  bad = (n_ge != k) & ((tau > _NEG_INF_KEY) | (n_ge > k))
  return (keys.reshape(r, -1) >= floor[:, None])[:, :s], bad


def _topk_mask_block(x: jax.Array, k: int, exact_topk: bool) -> jax.Array:
  """x [R,s] -> bool [R,s]: see topk_mask."""
  r, s = x.shape
  keys = _pad_last(_to_keys(x), 16, _IMIN).reshape(r, 16, -1)  # [R,16,L]: key of position g*L + l
  kth, n_ge = _threshold_keys(keys, k, count=exact_topk)  # [R], [R]
  return _mask_from_keys(keys.reshape(r, -1), kth[:, None], k, exact_topk, n_ge if exact_topk else None)[:, :s]


# ----------------------------------------------------------------------------- approximate top-k


def binned_recall(s: int, k: int, rows: int, m: int) -> float:
  """Expected recall of keeping the top m of each strided bin of `rows` keys (s/rows bins).

  The number of true top-k keys in one bin is hypergeometric (s keys, k of them top, `rows`
  drawn); a bin loses every one past its m-th, so recall = 1 - bins * E[(N - m)+] / k. This
  assumes the top-k positions are spread like a random draw over bins; strided bins (bin =
  position mod s/rows) make that hold for clustered top keys and for causal prefixes: a row with
  v valid keys has about v/(s/rows) of them per bin, and is exact when that is <= m.
  """
  bins = s // rows
  pmf = [math.comb(k, n) * math.comb(s - k, rows - n) / math.comb(s, rows) for n in range(rows + 1)]
  lost = sum(p * (n - m) for n, p in enumerate(pmf) if n > m)
  return 1.0 - bins * lost / k


def binned_config(s: int, k: int, recall_target: float) -> tuple[int, int] | None:
  """(rows per bin G, kept per bin m) of least estimated cost whose estimated recall clears the
  target with a margin (a quarter of 1 - target), or None when no binning beats exact top_k."""
  want = recall_target + 0.25 * (1.0 - recall_target)
  best = None
  for rows in (32, 16, 8, 4):  # 32: two 16-row bins merged (_binned_take)
    bins = -(-s // rows)
    for m in range(1, min(rows, 8)):  # m == rows would keep everything
      if m * bins < k:
        continue
      if binned_recall(bins * rows, k, rows, m) >= want:
        # m knock-out passes over every key + bisection/scatter on the candidates, weighted by
        # their measured costs per key and per candidate (docs/measured_choices.md)
        cost = m * bins * rows + 16 * m * bins
        if best is None or cost < best[0]:
          best = (cost, rows, m)
        break
  return None if best is None else best[1:]


def _pack(keys: jax.Array, g, rows: int) -> jax.Array:
  """Keys of bin row g (of `rows`) with the row in their low log2(rows) bits, reversed (ties go
  to the lower position): the keys of a bin are distinct, so each max pass knocks out one."""
  return (keys & ~(rows - 1)) | (rows - 1 - g)


def _merge_top(a: list, b: list) -> list:
  """The m largest of two decreasing lists of m [R,L] arrays (distinct entries), elementwise:
  the j-th (from 0) is max over p + q = j + 1 of min(a[p-1], b[q-1]), a[-1] = b[-1] = +inf.
  Elementwise on slices of one reduce's output: a reduce over them XLA:CPU fuses into the
  16-row reduce before it, and that fusion does not vectorize (docs/measured_choices.md)."""
  m = len(a)
  out = []
  for j in range(m):
    terms = [a[j], b[j]] + [jnp.minimum(a[p - 1], b[j - p]) for p in range(1, j + 1)]
    out.append(functools.reduce(jnp.maximum, terms))
  return out


def _binned_take(x: jax.Array, k: int, rows: int, m: int,
                 ties: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The binned selection of a block x [R,s]: the top m of each strided bin of `rows` keys, then
  the exact top k of those m * bins candidates. -> (keys [R,G,L], cand [R,m,L], take [R,m,L]):
  the int32 keys of position g*L + l (bin l, bin row g; IMIN pads); the m largest of each bin's
  keys packed with their bin row in the low bits (_pack; decreasing); and which candidates are
  taken (exactly k per row, a prefix of each bin).
  ties=False: take every candidate >= the k-th (more than k only where packed keys of different
  bins tie at it; _binned_mask_checked checks the count) with no lax.cond in the block."""
  r, s = x.shape
  h, f = min(rows, 16), max(1, rows // 16)  # XLA:CPU does not vectorize a reduce over > 16 rows
  keys = _pad_last(_to_keys(x), rows, _IMIN).reshape(r, rows, -1)  # [R,G,L]: key of position g*L + l
  bins = keys.shape[-1]
  g = lax.broadcasted_iota(jnp.int32, keys.shape, 1)
  packed = _pack(keys, g, rows).reshape(r, h, -1)  # [R,H,F*L]: bin row g = h*F + j // L of column j
  cand = _bin_levels(packed, m)  # [R,m,F*L]: the top m of each H-row bin
  if rows > h:  # the top m of a G-row bin: the top m of its F sub-bins' top m, merged
    subs = [[cand[:, j, i * bins:(i + 1) * bins] for j in range(m)] for i in range(f)]  # F x m x [R,L]
    cand = jnp.stack(functools.reduce(_merge_top, subs), axis=1)  # [R,m,L]
  thr = jax.vmap(_kth_key, in_axes=(0, None))(cand.reshape(r, -1), k)[:, None, None]  # [R,1,1]
  if not ties:
    return keys, cand, cand >= thr
  above, tied = cand > thr, cand == thr

  def first_ties(_):  # packed keys of different bins can tie at thr: take the first ones up to k
    need = k - jnp.sum(above, axis=(1, 2))[:, None, None]
    return above | (tied & (_exclusive_cumsum(tied.reshape(r, -1)).reshape(tied.shape) < need))

  take = lax.cond(jnp.any(jnp.sum(above | tied, axis=(1, 2)) > k), first_ties, lambda _: above | tied, None)
  return keys, cand, take


def _binned_mask_checked(scores: jax.Array, k: int, rows: int, m: int) -> jax.Array:
  """The mask of _binned_mask_block with no lax.cond per block (one made XLA:CPU materialize the
  candidates' operands: docs/measured_choices.md): each block takes every
  candidate >= the k-th; rows that took more than k (packed keys of two bins tied at the k-th)
  are rewritten by _binned_mask_block, which takes the first ties."""
  mask, bad = _map_blocks(lambda x: _binned_mask_block(x, k, rows, m, ties=False), scores)
  return _repair_rows(scores, mask, bad, lambda x: _binned_mask_block(x, k, rows, m)[0].join())


def _binned_mask_block(x: jax.Array, k: int, rows: int, m: int,
                       ties: bool = True) -> tuple[Columns, jax.Array]:
  """x [R,s] -> (bool [R,s] as Columns, over [R]): the positions _binned_topk_block selects, minus
  -inf/NaN scores, written directly: a key is taken iff it is >= its bin's smallest taken
  candidate (packed keys are distinct within a bin and the taken ones are a prefix of it), so no
  indices, scatter or gather (they cost more than the selection itself on CPU). over: more than k
  candidates were taken (only with ties=False, _binned_take; always False with ties)."""
  r, s = x.shape
  keys, cand, take = _binned_take(x, k, rows, m, ties)
  floor = jnp.min(jnp.where(take, cand, _IMAX), axis=1)  # [R,L]
  some = jnp.any(take, axis=1)  # [R,L]
  xs = _pad_last(x, rows, -jnp.inf).reshape(keys.shape)  # [R,G,L]
  # One [R,L] compare per bin row g (its row a constant), the columns g*L .. g*L + L - 1 of the
  # mask: XLA:CPU writes a compare against a [R,1,L] broadcast slower (docs/measured_choices.md).
  bins = keys.shape[-1]
  mask = Columns((_pack(keys[:, g], g, rows) >= floor) & some & (xs[:, g] > -jnp.inf)  # NaN: False
                 for g in range(rows) if g * bins < s)
  return Columns(mask[:-1] + (mask[-1][:, :s - (len(mask) - 1) * bins],)), jnp.sum(take, axis=(1, 2)) > k


def _binned_topk_block(x: jax.Array, k: int, rows: int, m: int) -> tuple[jax.Array, jax.Array]:
  """Approximate top-k of a block x [R,s] (_binned_take): (values [R,k], indices [R,k]), unsorted
  but for the last slot, which holds each row's smallest selected value."""
  r, s = x.shape
  _, cand, take = _binned_take(x, k, rows, m)
  bins = cand.shape[-1]
  # Exactly k taken per row, a prefix of each bin's levels: slot = bin offset + level.
  offset = _exclusive_cumsum(jnp.sum(take, axis=1))  # [R,L]
  level = lax.broadcasted_iota(jnp.int32, cand.shape, 1)
  flat = jnp.arange(r)[:, None, None] * k + offset[:, None, :] + level  # [R,m,L] into [R*k]
  flat = jnp.where(take, flat, r * k + jnp.arange(cand.size).reshape(cand.shape))  # distinct, dropped
  pos = (rows - 1 - (cand & (rows - 1))) * bins + lax.broadcasted_iota(jnp.int32, cand.shape, 2)
  idx = jnp.zeros((r * k,), jnp.int32).at[flat.reshape(-1)].set(pos.reshape(-1), mode="drop",
                                                                  unique_indices=True).reshape(r, k)
  pad = idx >= s  # a padding key (lowest of all) is taken only where a row has no other candidate
  idx = jnp.minimum(idx, s - 1)
  vals = jnp.where(pad, -jnp.inf, _sanitize(jnp.take_along_axis(x, idx, axis=1)))  # [R,k]
  # Swap the smallest value into the last slot, so values[..., -1:] is the cutoff as with top_k
  # (in int keys: argmin and gathers cost more than these reductions on CPU).
  kv = _to_keys(vals)  # [R,k]
  col = lax.broadcasted_iota(jnp.int32, kv.shape, 1)
  kmin = jnp.min(kv, axis=1, keepdims=True)  # [R,1]
  j = jnp.min(jnp.where(kv == kmin, col, k), axis=1, keepdims=True)  # [R,1] first smallest
  idx_j = jnp.take_along_axis(idx, j, axis=1)  # [R,1]
  swap = lambda a, a_j: jnp.where(col == k - 1, a_j, jnp.where(col == j, a[:, -1:], a))
  return swap(vals, _from_keys(kmin)), swap(idx, idx_j)


def select_topk(scores: jax.Array, k: int, *, approx: bool = False,
                recall_target: float = 0.95) -> tuple[jax.Array, jax.Array]:
  """scores [..., s] -> (values [..., k'], indices [..., k'] int32), k' = min(k, s).

  approx=False: jax.lax.top_k (sorted, ties lowest index first), every backend.
  approx=True:  approx_selection "approx_max_k" (portable): jax.lax.approx_max_k(recall_target=...).
    "binned" (CPU): the binned method:
    strided bins (bin = position mod s/G) of G in {4,8,16,32} keys, the top m of each bin by m
    knock-out max passes over int32 keys (G=32: two 16-key bins' top m, merged), then the exact
    top k' of the m*bins candidates by bisection (_kth_key) and a scatter. (G, m) is the cheapest
    pair whose hypergeometric recall estimate (binned_recall) clears recall_target; when none
    does, exact lax.top_k runs.
    The binned result is unsorted except that the last entry is the smallest value.
  NaN counts as -inf; entries with value -inf (row with fewer than k' finite keys) are not
  valid selections (see selection_indices).
  """
  if k < 1 or not 0.0 < recall_target <= 1.0:
    raise ValueError(f"select_topk: need k >= 1 and 0 < recall_target <= 1, got k={k}, "
                     f"recall_target={recall_target}")
  kk = min(k, scores.shape[-1])
  if not approx:
    return lax.top_k(_sanitize(scores), kk)
  if backend.choice("approx_selection") == "approx_max_k":
    return lax.approx_max_k(_sanitize(scores), kk, recall_target=recall_target)
  config = binned_config(scores.shape[-1], kk, recall_target)
  if config is None:
    return lax.top_k(_sanitize(scores), kk)
  return _map_blocks(lambda x: _binned_topk_block(x, kk, *config), scores)


def selection_indices(scores: jax.Array, k: int, *, approx: bool = False,
                      recall_target: float = 0.95) -> tuple[jax.Array, jax.Array]:
  """The selection as indices [..., k'] int32 and valid [..., k'] bool (False where a row has
  fewer than k' finite scores: those slots hold some index with a -inf/NaN score), for a
  gather-based sparse attention. Exact: lax.top_k; approx: as select_topk."""
  values, indices = select_topk(scores, k, approx=approx, recall_target=recall_target)
  return indices, values > -jnp.inf


# ----------------------------------------------------------------------------- masks


def generate_mask(scores: jax.Array, topk_values: jax.Array, topk_indices: jax.Array | None = None, *,
                  exact_topk: bool = True, k: int | None = None) -> jax.Array:
  """bool [..., s], True = attend.

  cutoff = the smallest of topk_values [..., k'] (= topk_values[..., -1:] when sorted), or a
  threshold [..., 1] from topk_threshold (then pass k). k defaults to topk_values.shape[-1].
  exact_topk=True:  exactly min(k', #valid) keys: all keys above the cutoff, then keys equal to
                    it lowest position first (the set lax.top_k returns). With topk_indices
                    (an approximate selection): exactly those indices, minus any whose value is
                    -inf/NaN, by a scatter.
  exact_topk=False: every key scoring >= cutoff (k' or more under ties).
  A -inf or NaN score is never selected, also where fewer than k' keys are valid (cutoff -inf).
  The tie fix (an exclusive prefix count of the ties) runs only in blocks of rows that have more
  ties at the cutoff than they need (a lax.cond per block; a select under vmap).
  """
  s = scores.shape[-1]
  kk = min(k if k is not None else topk_values.shape[-1], s)
  values = _sanitize(topk_values)
  if exact_topk and topk_indices is not None:
    idx = topk_indices.reshape(-1, topk_indices.shape[-1])  # [N,k']
    n = idx.shape[0]
    idx = jnp.where(values.reshape(idx.shape) > -jnp.inf, idx, s)  # -inf/NaN value: dropped below
    if n * s < 2**31:  # one flat scatter (faster on CPU than [N,s] row/column indices)
      flat = jnp.where(idx < s, idx + s * jnp.arange(n)[:, None], n * s)  # [N,k'] into [N*s]
      mask = jnp.zeros((n * s,), bool).at[flat.reshape(-1)].set(True, mode="drop")
    else:
      mask = jnp.zeros((n, s), bool).at[jnp.arange(n)[:, None], idx].set(True, mode="drop")
    return mask.reshape(scores.shape)
  cutoff = jnp.min(values, axis=-1, keepdims=True)  # [...,1]
  return _map_blocks(lambda sc, cu: _threshold_mask_block(sc, cu, kk, exact_topk), scores, cutoff)


def _threshold_mask_block(scores: jax.Array, cutoff: jax.Array, k: int, exact_topk: bool) -> jax.Array:
  """scores [R,s], cutoff [R,1] -> bool [R,s]: see generate_mask (threshold form)."""
  return _mask_from_keys(_to_keys(scores), _to_keys(cutoff), k, exact_topk)


def _mask_from_keys(keys: jax.Array, cut: jax.Array, k: int, exact_topk: bool, n_ge=None) -> jax.Array:
  """keys [R,n], cut [R,1] (the cutoff's key) -> bool [R,n]: keys >= cut, never -inf/NaN; with
  exact_topk, ties at the cutoff lowest position first up to k. n_ge [R]: #(keys >= cut) if
  already counted (else counted here)."""
  floor = jnp.maximum(cut, _NEG_INF_KEY + 1)  # >= cutoff, and never -inf/NaN
  raw = keys >= floor  # [R,n]
  if not exact_topk:
    return raw

  def keep_first_ties(keys):
    # Keep everything strictly above the cutoff; prune only the ties (a cumsum over the whole
    # raw mask would drop maxima that come after ties).
    above = keys > jnp.maximum(cut, _NEG_INF_KEY)
    tied = (keys == cut) & (cut > _NEG_INF_KEY)
    need = k - jnp.sum(above, axis=-1, keepdims=True)
    return above | (tied & (_exclusive_cumsum(tied) < need))

  # Rows with more ties at the cutoff than they need are rare: pay for the prefix count only in
  # the blocks that have one (a lax.cond per block; under vmap it becomes a select).
  if n_ge is None:
    count = _count_ge(_pad_last(keys, 16, _IMIN).reshape(keys.shape[0], 16, -1), floor[:, 0])
  else:  # a -inf (or NaN) cutoff: fewer than k finite keys, all kept, no ties to prune
    count = jnp.where(cut[:, 0] > _NEG_INF_KEY, n_ge, 0)
  return lax.cond(jnp.any(count > k), keep_first_ties, lambda _: raw, keys)


def generate_mask_reference(topk_indices: jax.Array, s: int) -> jax.Array:
  """The original all-pairs index-compare mask, bool [..., s]: the oracle for every fast path.
  O(k*s) memory per row ([..., k, s] intermediate)."""
  return (jnp.arange(s) == topk_indices[..., None]).any(axis=-2)


def additive_mask(mask: jax.Array, dtype=jnp.float32) -> jax.Array:
  """0 where mask is True, else a large negative FINITE value (-0.7 * max of dtype, as MaxText).

  Not -inf: a fully masked row would then softmax to exp(-inf - -inf) = NaN. And not the dtype's
  minimum either, so adding it to negative logits cannot overflow to -inf.
  """
  return jnp.where(mask, jnp.zeros((), dtype), jnp.asarray(-0.7 * float(jnp.finfo(dtype).max), dtype))
