"""Top-k selection for the lightning indexer (MaxText/kernels/selection.py): exact k-th value,
masks (exact-k with ties, raw cutoff, approximate index set), the all-pairs reference mask,
the binned approximate top-k and its recall, against lax.top_k and a float64 numpy oracle."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from MaxText.kernels import backend
from MaxText.kernels import selection as sel
from MaxText.kernels import selection_keys as sk

pytestmark = pytest.mark.device  # runs unchanged on one GPU or TPU (tools/device/device_check.sh)

NEG_INF = -np.inf


# Module-level jits (static k / flags) so tests that share a shape share one compile.
select_topk = jax.jit(sel.select_topk, static_argnames=("k", "approx", "recall_target"))
topk_threshold = jax.jit(sel.topk_threshold, static_argnames=("k",))
topk_mask = jax.jit(sel.topk_mask, static_argnames=("k", "exact_topk"))
generate_mask = jax.jit(sel.generate_mask, static_argnames=("exact_topk", "k"))


def _sanitized(scores):
  return jnp.where(jnp.isnan(scores), -jnp.inf, scores)


def _reference_mask(scores, k):
  """The seed's all-pairs mask of lax.top_k's indices (NaN read as -inf), minus -inf keys."""
  x = _sanitized(jnp.asarray(scores, jnp.float32))
  idx = jax.lax.top_k(x, min(k, x.shape[-1]))[1]
  return np.asarray(sel.generate_mask_reference(idx, x.shape[-1]) & (x > -jnp.inf))


@functools.partial(jax.jit, static_argnums=1)
def _all_paths(scores, k):
  """Every selection path for one (shape, k), in one compile (hypothesis reuses a few shapes)."""
  threshold = sel.topk_threshold(scores, k)
  exact = sel.generate_mask(scores, threshold, exact_topk=True, k=k)
  raw = sel.generate_mask(scores, threshold, exact_topk=False, k=k)
  values, indices = sel.select_topk(scores, k, approx=True, recall_target=0.9)
  approx = sel.generate_mask(scores, values, indices, exact_topk=True, k=k)
  fused = (sel.topk_mask(scores, k), sel.topk_mask(scores, k, exact_topk=False),
           sel.topk_mask(scores, k, approx=True, recall_target=0.9))
  return threshold, exact, raw, values, indices, approx, fused


def _recall(indices, exact_indices, valid):
  """Fraction of the valid exact top-k found by the approximate indices, over all rows."""
  indices, exact_indices, valid = (np.asarray(a).reshape(-1, a.shape[-1]) for a in (indices, exact_indices, valid))
  hit = sum(np.isin(want[ok], got).sum() for got, want, ok in zip(indices, exact_indices, valid))
  return hit / valid.sum()


# ----------------------------------------------------------------------------- seed tests


def test_approx_paths_trace_and_compile_under_jit():
  shape = jax.ShapeDtypeStruct((2, 8, 512), jnp.float32)
  approx, xla, mask = (jax.jit(fn).lower(shape).compile() for fn in (
      lambda x: sel.select_topk(x, 32, approx=True),
      lambda x: jax.lax.approx_max_k(x, 32, recall_target=0.95),
      lambda x: sel.generate_mask(x, *sel.select_topk(x, 32, approx=True), k=32)))
  exact = jax.jit(lambda x: sel.select_topk(x, 32)).lower(shape).compile()
  top_k_op = re.compile(r"\b(TopK|sort)\b")
  assert top_k_op.search(exact.as_text())
  if backend.choice("approx_selection") == "binned":  # the binned method compiled, not lax.top_k's sort
    assert not top_k_op.search(approx.as_text())

  scores = jax.random.normal(jax.random.key(2), shape.shape, jnp.float32)
  want = np.asarray(jax.lax.top_k(scores, 32)[1])
  valid = np.ones(want.shape, bool)
  for values, indices in (approx(scores), xla(scores)):
    values, indices = np.asarray(values), np.asarray(indices)  # [2,8,32]
    assert (np.sort(indices, -1)[..., 1:] > np.sort(indices, -1)[..., :-1]).all()  # 32 distinct keys
    np.testing.assert_array_equal(values, np.take_along_axis(np.asarray(scores), indices, -1))
    assert _recall(indices, want, valid) >= 0.95
  got = np.asarray(mask(scores))  # [2,8,512]: exactly the approximate index set
  np.testing.assert_array_equal(got, np.asarray(sel.generate_mask_reference(approx(scores)[1], 512)))
  assert (got.sum(-1) == 32).all()


def test_approx_recall_on_random_4x16x1024_k64():
  scores = jax.random.normal(jax.random.key(0), (4, 16, 1024), jnp.float32)
  exact = jax.lax.top_k(scores, 64)[1]
  valid = np.ones(exact.shape, bool)
  _, ours = select_topk(scores, 64, approx=True, recall_target=0.95)
  _, xla = jax.lax.approx_max_k(scores, 64, recall_target=0.95)
  assert sel.binned_config(1024, 64, 0.95) is not None  # the binned method really runs here
  assert _recall(ours, exact, valid) >= 0.95
  assert _recall(xla, exact, valid) >= 0.95


def test_threshold_mask_equals_exact_selection_on_unique_scores():
  scores = jax.random.permutation(jax.random.key(1), jnp.arange(2 * 3 * 97, dtype=jnp.float32)).reshape(2, 3, 97)
  for k in (1, 97):
    threshold, exact, raw, *_ = _all_paths(scores, k)
    np.testing.assert_array_equal(threshold, jax.lax.top_k(scores, k)[0][..., -1:])
    np.testing.assert_array_equal(exact, _reference_mask(scores, k))
    np.testing.assert_array_equal(raw, exact)  # no ties: raw and exact agree


TIED = [0.9, 0.8, 0.5, 0.5, 0.1, 0.0, -1.0, -2.0, -3.0, -4.0]
TIED_UNSORTED = [0.5, 0.5, 0.9, 0.8, 0.1, 0.0, -1.0, -2.0, -3.0, -4.0]


def test_raw_cutoff_under_ties_selects_k_plus_the_extra_ties():
  scores = jnp.array([[TIED]])
  mask = generate_mask(scores, jax.lax.top_k(scores, 3)[0], exact_topk=False)
  np.testing.assert_array_equal(np.flatnonzero(mask[0, 0]), [0, 1, 2, 3])


def test_exact_k_under_ties_selects_exactly_k_first_tie_first():
  scores = jnp.array([[TIED, [0.7, 0.6, 0.5, 0.2, 0.1, 0.0, -1.0, -2.0, -3.0, -4.0]]])
  mask = generate_mask(scores, jax.lax.top_k(scores, 3)[0], exact_topk=True)
  np.testing.assert_array_equal(np.flatnonzero(mask[0, 0]), [0, 1, 2])
  np.testing.assert_array_equal(np.flatnonzero(mask[0, 1]), [0, 1, 2])


def test_exact_k_with_unsorted_ties_keeps_the_maxima_after_them():
  """The seed review's bug: a cumsum over the whole raw mask dropped 0.9 and 0.8 here."""
  scores = jnp.array([[TIED_UNSORTED]])
  for values in (jax.lax.top_k(scores, 3)[0], topk_threshold(scores, 3)):
    mask = generate_mask(scores, values, exact_topk=True, k=3)
    np.testing.assert_array_equal(np.flatnonzero(mask[0, 0]), [0, 2, 3])


def test_sequence_shorter_than_k():
  scores = jnp.array([[[0.3, -jnp.inf, 0.7, 0.1, -jnp.inf]]])
  values, indices = select_topk(scores, 8)
  assert values.shape == indices.shape == (1, 1, 5)  # k clamped to s
  want = [[[True, False, True, True, False]]]
  for exact in (True, False):
    np.testing.assert_array_equal(generate_mask(scores, values, exact_topk=exact, k=8), want)
    np.testing.assert_array_equal(generate_mask(scores, topk_threshold(scores, 8), exact_topk=exact, k=8), want)
  idx, valid = sel.selection_indices(scores, 8)
  np.testing.assert_array_equal(np.sort(np.asarray(idx)[np.asarray(valid)]), [0, 2, 3])
  np.testing.assert_array_equal(topk_threshold(scores, 8), [[[-np.inf]]])


# ----------------------------------------------------------------------------- properties

CASES = [((1, 1, 9), 3), ((2, 3, 40), 1), ((2, 3, 40), 16), ((1, 2, 130), 5)]  # (shape, k)
TIE_VALUES = [NEG_INF, np.nan, -2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf]


@st.composite
def score_batches(draw):
  """A few fixed shapes (to reuse compiles), heavily duplicated values or distinct floats,
  with whole -inf rows, causal-style -inf suffixes and NaNs."""
  shape, k = draw(st.sampled_from(CASES))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  if draw(st.booleans()):
    x = rng.choice(np.array(TIE_VALUES, np.float32), size=shape)
  else:
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.05] = np.nan
  s = shape[-1]
  valid_len = rng.integers(0, s + 1, size=shape[:-1])  # per-row valid prefix (0 = fully masked row)
  x = np.where(np.arange(s) < valid_len[..., None], x, NEG_INF) if draw(st.booleans()) else x
  return x.astype(np.float32), k


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(score_batches())
def test_every_path_keeps_the_selection_invariants(batch):
  x, k = batch
  s = x.shape[-1]
  kk = min(k, s)
  threshold, exact, raw, values, indices, approx, fused = jax.tree.map(np.asarray, _all_paths(jnp.asarray(x), k))
  finite = ~np.isnan(x) & (x > NEG_INF)
  want = _reference_mask(x, k)
  expected_count = np.minimum(kk, finite.sum(-1))
  # the k-th value is lax.top_k's, sign of zero included
  top_vals = np.asarray(jax.lax.top_k(_sanitized(jnp.asarray(x)), kk)[0][..., -1:])
  np.testing.assert_array_equal(threshold, top_vals)
  np.testing.assert_array_equal(np.signbit(threshold), np.signbit(top_vals))
  # exact-k: the reference set, min(k, valid) keys, never a masked or NaN key
  np.testing.assert_array_equal(exact, want)
  np.testing.assert_array_equal(exact.sum(-1), expected_count)
  assert not (exact & ~finite).any() and not (raw & ~finite).any() and not (approx & ~finite).any()
  # the fused threshold + mask: the same masks
  np.testing.assert_array_equal(fused[0], exact)
  np.testing.assert_array_equal(fused[1], raw)
  # raw cutoff: a superset, at least min(k, valid)
  assert not (want & ~raw).any()
  assert (raw.sum(-1) >= expected_count).all()
  # approximate: k' distinct in-range indices, values are the scores there, the mask is that set
  assert indices.shape == x.shape[:-1] + (kk,) and (indices >= 0).all() and (indices < s).all()
  np.testing.assert_array_equal(values, np.take_along_axis(np.where(np.isnan(x), NEG_INF, x), indices, -1))
  assert all(len(np.unique(r)) == kk for r in indices.reshape(-1, kk))
  ref = np.asarray(sel.generate_mask_reference(jnp.asarray(indices), s)) & finite
  np.testing.assert_array_equal(approx, ref)
  np.testing.assert_array_equal(fused[2], approx)  # the approx mask written per block: that set
  np.testing.assert_array_equal(approx.sum(-1), (values > NEG_INF).sum(-1))
  np.testing.assert_array_equal(values[..., -1], values.min(-1))  # the cutoff sits last


def _numpy_topk_positions(x, k):
  """float64 oracle independent of lax.top_k: a stable sort on -x, NaN as -inf, ties lowest
  position first; -inf keys are never selected."""
  x = np.where(np.isnan(x), -np.inf, np.asarray(x, np.float64))
  order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
  mask = np.zeros(x.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  kth = np.take_along_axis(x, order[..., -1:], -1)
  return mask & (x > -np.inf), kth


@pytest.mark.parametrize("k", [1, 7, 50])
def test_exact_paths_match_a_float64_numpy_oracle_under_heavy_ties(k):
  rng = np.random.default_rng(k)
  x = rng.choice(np.array([-np.inf, np.nan, -1.5, 0.0, 0.25, 2.0], np.float32), size=(3, 5, 64))
  want_mask, want_kth = _numpy_topk_positions(x, k)
  xj = jnp.asarray(x)
  threshold = topk_threshold(xj, k)
  np.testing.assert_array_equal(np.asarray(threshold, np.float64), want_kth)
  np.testing.assert_array_equal(generate_mask(xj, threshold, k=k), want_mask)


def _one_level_rows():
  """8 rows of 4096 (one block, hi tried from each bin's smallest key above lo first). Row 0:
  the 4 smallest of its top 64 (1000..1003) and its largest background key (0.999) share bin 0
  (bin = position mod 256), so lo misses 1000 and 1001, r = 3, and the 3 smallest keys above lo
  are the top background key of another bin, 0.999 and 1000: one level per bin sees 0.999 but not
  1000, its proof fails, and two levels close it. Rows 1..7: random (some close at one level)."""
  assert sel._one_level_closes(4096, 64, 8)
  x = np.random.default_rng(4).uniform(0.0, 0.99, (8, 4096)).astype(np.float32)
  x[1:] = np.random.default_rng(5).standard_normal((7, 4096))
  x[0, [0, 256, 512, 768]] = [1000.0, 1001.0, 1002.0, 1003.0]
  x[0, 5:65] = 1004.0 + np.arange(60)
  x[0, 1024] = 0.999
  return jnp.asarray(x)


def test_threshold_is_exact_in_every_branch_of_its_bounds():
  """_threshold_block's outcomes: lo already exact (k=1), lo closed by hi (random, k=64), hi
  from one key per bin closing some rows and failing on one that two keys per bin close
  (_one_level_rows), and the fallback bisection over all keys: heavy ties (all equal) and an
  adversarial row whose top keys all sit in one strided bin (positions = 3 mod 16)."""
  periodic = jnp.where(jnp.arange(256) % 16 == 3, 1000.0, 0.0) + jnp.arange(256.0)
  rand = jax.random.normal(jax.random.key(0), (2, 1024))
  cases = [(rand, 1), (rand, 64),
           (jnp.ones((2, 64)), 5), (jnp.tile(periodic, (2, 1)), 8)]
  for x, k in cases + [(_one_level_rows(), 64)]:
    np.testing.assert_array_equal(topk_threshold(x, k), jax.lax.top_k(x, k)[0][..., -1:])
    # topk_mask reuses each branch's count of keys >= the k-th for its tie check
    np.testing.assert_array_equal(topk_mask(x, k), _numpy_topk_positions(np.asarray(x), k)[0])


# ----------------------------------------------------------------------------- recall of the binned method


def _causal_scores(key, b, t, s):
  """Random scores where query i sees a valid prefix of keys (a causal mask with t < s queries
  at the end of the sequence, plus short prefixes so some rows have fewer than k keys)."""
  x = jax.random.normal(key, (b, t, s), jnp.float32)
  valid_len = jnp.concatenate([jnp.arange(1, t // 2 + 1) * 8, jnp.linspace(s // 2, s, t - t // 2).astype(jnp.int32)])
  return jnp.where(jnp.arange(s) < valid_len[:, None], x, -jnp.inf)


@pytest.mark.parametrize("recall_target", [0.9, 0.99])
@pytest.mark.parametrize("causal", [False, True])
def test_binned_approx_reaches_its_recall_target(recall_target, causal):
  b, t, s, k = 2, 64, 4096, 256
  key = jax.random.key(7)
  scores = _causal_scores(key, b, t, s) if causal else jax.random.normal(key, (b, t, s), jnp.float32)
  assert sel.binned_config(s, k, recall_target) is not None
  exact_vals, exact_idx = jax.lax.top_k(scores, k)
  values, indices = select_topk(scores, k, approx=True, recall_target=recall_target)
  valid = np.asarray(exact_vals > -jnp.inf)
  assert _recall(indices, exact_idx, valid) >= recall_target
  if causal:  # rows with at most k valid keys: every one of them, exactly
    short = np.asarray(valid.sum(-1) < k)
    got = np.asarray(generate_mask(scores, values, indices, k=k))[short]
    np.testing.assert_array_equal(got, np.asarray(scores > -jnp.inf)[short])


def test_recall_estimate_is_close_to_measured():
  s, k = 8192, 512
  rows, m = sel.binned_config(s, k, 0.95)
  estimate = sel.binned_recall(s, k, rows, m)
  scores = jax.random.normal(jax.random.key(3), (1, 64, s), jnp.float32)
  with backend.forced(approx_selection="binned"):  # the binned method's estimate, on any backend
    _, indices = jax.jit(lambda x: sel.select_topk(x, k, approx=True, recall_target=0.95))(scores)
  measured = _recall(indices, jax.lax.top_k(scores, k)[1], np.ones((1, 64, k), bool))
  assert 0.95 <= estimate and abs(measured - estimate) < 0.01


def test_binned_config_falls_back_to_exact_when_binning_cannot_pay():
  assert sel.binned_config(64, 64, 0.95) is None  # k == s: keeping every key
  x = jax.random.normal(jax.random.key(0), (2, 64), jnp.float32)
  values, indices = select_topk(x, 64, approx=True)
  np.testing.assert_array_equal(indices, jax.lax.top_k(x, 64)[1])


# ----------------------------------------------------------------------------- blocks, shapes, vmap, additive


def test_row_blocks_with_padding_match_top_k():
  """On CPU rows go through lax.map in cache-sized blocks (16 rows at s=16384); 21 rows need padding."""
  x = jax.random.normal(jax.random.key(5), (3, 7, 16384), jnp.float32)
  assert sk._block_rows(16384, sk._CACHE_BYTES) == 16
  threshold = topk_threshold(x, 300)
  np.testing.assert_array_equal(threshold, jax.lax.top_k(x, 300)[0][..., -1:])
  np.testing.assert_array_equal(generate_mask(x, threshold, k=300), _reference_mask(x, 300))
  values, indices = select_topk(x, 300, approx=True)
  np.testing.assert_array_equal(values, jnp.take_along_axis(x, indices, -1))
  np.testing.assert_array_equal(generate_mask(x, values, indices, k=300).sum(-1), np.full((3, 7), 300))


def test_fused_mask_counts_ties_per_row_in_a_block_mixing_both_bounds():
  """One block, two rows: row 0's bin 0 holds 3 of its top 8 (lo misses one, hi closes it);
  row 1's lo is exact but 252 zeros tie at it. The tie check must count keys >= each row's own
  k-th (row 1: lo, not the hi its block computed)."""
  row0 = np.arange(256, dtype=np.float32)
  top = np.array([0, 16, 32, 1, 17, 2, 18, 3])  # bins 0,0,0,1,1,2,2,3 (bin = position mod 16)
  row0[top], row0[248:] = row0[248:], row0[top]
  row1 = np.zeros(256, np.float32)
  row1[[5, 70, 135, 200]] = 1.0
  x = np.stack([row0, row1])
  got = np.asarray(topk_mask(jnp.asarray(x), 8))
  np.testing.assert_array_equal(np.flatnonzero(got[0]), np.sort(top))
  np.testing.assert_array_equal(np.flatnonzero(got[1]), [0, 1, 2, 3, 5, 70, 135, 200])


def test_fused_mask_at_s131072_two_rows_per_block_with_causal_rows():
  """The seed's shape regime: at s=131072 a cache-sized block holds 2 rows, so 5 rows are 3 blocks
  (one padded). Causal rows (valid prefixes shorter than, equal to, just above k, and full) with
  a few planted ties at each row's k-th value, against a float64 numpy oracle."""
  s, k = 131072, 2048
  assert sk._block_rows(s, sk._CACHE_BYTES) == 2
  rng = np.random.default_rng(19)
  valid_len = np.array([1000, k, k + 1, 70000, s])
  x = np.where(np.arange(s) < valid_len[:, None], rng.standard_normal((5, s)), -np.inf).astype(np.float32)
  for row in (2, 3, 4):  # 3 extra copies of the row's k-th value, anywhere in its valid prefix
    x[row, rng.choice(valid_len[row], 3, replace=False)] = np.sort(x[row])[-k]
  want, _ = _numpy_topk_positions(x, k)
  got = np.asarray(topk_mask(jnp.asarray(x), k))
  np.testing.assert_array_equal(got.sum(-1), np.minimum(k, valid_len))
  np.testing.assert_array_equal(got, want)


def test_shapes_are_batch_agnostic_and_vmappable():
  x = jax.random.normal(jax.random.key(2), (2, 3, 4, 50), jnp.float32)
  kth = jax.lax.top_k(x, 6)[0][..., -1:]
  np.testing.assert_array_equal(topk_threshold(x, 6), kth)
  np.testing.assert_array_equal(topk_threshold(x[0, 0, 0], 6), kth[0, 0, 0])

  @jax.jit
  def vmapped(x):  # one row at a time under vmap: lax.map and lax.cond inside must batch
    row_mask = lambda r: sel.generate_mask(r, sel.topk_threshold(r, 6), k=6)
    return jax.vmap(lambda r: sel.topk_threshold(r, 6))(x), jax.vmap(row_mask)(x), jax.vmap(
        lambda r: sel.select_topk(r, 6, approx=True))(x)

  kth_v, mask_v, (values, indices) = vmapped(x)
  np.testing.assert_array_equal(kth_v, kth)
  np.testing.assert_array_equal(mask_v, _reference_mask(x, 6))
  assert values.shape == indices.shape == (2, 3, 4, 6)
  np.testing.assert_array_equal(values, jnp.take_along_axis(x, indices, -1))


def test_selection_indices_flags_rows_with_fewer_valid_keys():
  x = jnp.array([[1.0, 2.0, 3.0, 4.0], [-jnp.inf, 5.0, jnp.nan, -jnp.inf]])
  idx, valid = sel.selection_indices(x, 3)
  np.testing.assert_array_equal(valid, [[True, True, True], [True, False, False]])
  assert idx[1, 0] == 1


def test_additive_mask_is_finite_and_a_fully_masked_row_softmaxes_without_nan():
  mask = jnp.array([[True, False, True], [False, False, False]])
  for dtype in (jnp.float32, jnp.bfloat16):
    add = sel.additive_mask(mask, dtype)
    assert add.dtype == dtype and bool(jnp.isfinite(add).all())
    np.testing.assert_array_equal(add[0] == 0, mask[0])
    logits = jnp.array([[1.0, 50.0, -3.0], [-1e4, 2.0, 0.0]], dtype) + add
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    assert not bool(jnp.isnan(probs).any())
    assert float(probs[0, 1]) == 0.0


def test_reference_mask_is_the_all_pairs_index_compare():
  idx = jnp.array([[[3, 0]], [[1, 1]]])
  np.testing.assert_array_equal(sel.generate_mask_reference(idx, 4),
                                [[[True, False, False, True]], [[False, True, False, False]]])


def test_binned_ties_across_bins_never_displace_a_larger_candidate():
  """Packed keys tie across bins (same value, same bin row). Taking every tie and letting the
  scatter drop the overflow would lose the 1.0 at position 63 (bin 3, last in slot order)."""
  row = jnp.zeros((64,), jnp.float32).at[60:].set(1.0)  # 4 bins of 16: the 1.0s head bins 0..3
  values, indices = jax.jit(lambda x: sel._binned_topk_block(x, 6, 16, 2))(row[None])
  assert {60, 61, 62, 63} <= set(np.asarray(indices[0]).tolist())
  assert len(set(np.asarray(indices[0]).tolist())) == 6 and float(values[0, -1]) == 0.0
  mask = jax.jit(lambda x: sel._binned_mask_block(x, 6, 16, 2)[0].join())(row[None])  # the same set, as a mask
  np.testing.assert_array_equal(np.flatnonzero(mask[0]), np.sort(np.asarray(indices[0])))


def _binned_oracle(x, k, rows, m):
  """numpy: positions p = g*L + l (L = ceil(s/rows), bin l), the m largest of each bin, then the
  k largest of those candidates (x distinct: no packing or tie rule matters)."""
  s = x.shape[-1]
  bins = -(-s // rows)
  xp = np.full((x.shape[0], rows * bins), -np.inf)
  xp[:, :s] = x
  per_bin = xp.reshape(-1, rows, bins)  # [R,G,L]
  top_rows = np.argsort(-per_bin, axis=1, kind="stable")[:, :m]  # [R,m,L]: each bin's m largest
  cand_pos = top_rows * bins + np.arange(bins)  # [R,m,L]
  cand_val = np.take_along_axis(xp, cand_pos.reshape(x.shape[0], -1), 1)
  best = np.argsort(-cand_val, axis=1, kind="stable")[:, :k]
  mask = np.zeros(xp.shape, bool)
  np.put_along_axis(mask, np.take_along_axis(cand_pos.reshape(x.shape[0], -1), best, 1), True, 1)
  return mask[:, :s]


@pytest.mark.parametrize("s,rows,m", [(4096, 32, 2), (4000, 32, 3), (4096, 16, 2), (4000, 8, 1)])
def test_binned_selection_matches_a_numpy_oracle_of_its_bins(s, rows, m):
  """_binned_take's set (the top m of each strided bin of `rows` keys, then the top k of the
  candidates) against numpy, for 32-key bins (two 16-key bins' top m merged) and single
  reduces, with and without padding: distinct integer scores (no two keys share their high bits,
  so the bin row packed into the low bits never reorders them)."""
  k = 100
  rng = np.random.default_rng(rows + m + s)
  x = np.stack([rng.permutation(s) - s // 2 for _ in range(4)]).astype(np.float32)  # [4, s]
  want = _binned_oracle(x, k, rows, m)
  mask = jax.jit(lambda x: sel._binned_mask_block(x, k, rows, m)[0].join())(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(mask), want)
  _, indices = jax.jit(lambda x: sel._binned_topk_block(x, k, rows, m))(jnp.asarray(x))
  got = np.zeros_like(want)
  np.put_along_axis(got, np.asarray(indices), True, 1)
  np.testing.assert_array_equal(got, want)



def test_fused_approx_mask_repairs_the_rows_whose_bins_tie_at_the_kth():
  """topk_mask(approx) takes every candidate >= the k-th with no lax.cond per block; rows where
  packed keys of several bins tie at it take more than k and are redone by the first-ties block.
  A block mixing such rows with random ones: select_topk(approx)'s set, exactly k per row."""
  s, k = 4096, 64
  config = sel.binned_config(s, k, 0.95)
  assert config is not None and 128 * k >= s  # the per-block fused mask runs
  x = jax.random.normal(jax.random.key(11), (1, 8, s), jnp.float32)
  x = x.at[0, ::2].set(jnp.round(x[0, ::2] * 2) / 2)  # even rows: 15 distinct values, ties everywhere
  fast = sk._map_blocks(lambda b: sel._binned_mask_block(b, k, *config, ties=False), x)[1]
  assert bool(fast[0, ::2].any()) and not bool(fast[0, 1::2].any())  # the repair runs on tied rows only
  mask = np.asarray(jax.jit(lambda x: sel.topk_mask(x, k, approx=True))(x))
  values, indices = select_topk(x, k, approx=True, recall_target=0.95)
  np.testing.assert_array_equal(mask, np.asarray(generate_mask(x, values, indices, k=k)))
  np.testing.assert_array_equal(mask.sum(-1), k)
