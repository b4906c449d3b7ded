"""kernels/kth_value.py's Pallas kernel (interpret mode on the CPU) against lax.top_k's k-th value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import backend, kth_value, selection
from MaxText.kernels.selection_keys import _sanitize


def _want(x: np.ndarray, k: int) -> np.ndarray:
  return np.asarray(jax.lax.top_k(_sanitize(jnp.asarray(x)), k)[0][..., -1:])


@pytest.mark.parametrize("shape,k", [((3, 200), 1), ((3, 200), 200), ((2, 5, 129), 17), ((9, 64), 64), ((1, 300), 150)])
def test_kth_largest_is_lax_top_ks_kth_value_with_ties_infinities_and_nans(shape, k):
  # Rows not a multiple of 8, keys not a multiple of 128 (both padded with -inf), ties at the k-th, -0 / +0, rows with
  # fewer than k finite scores (-> -inf), NaN (read as -inf), +inf, the largest and smallest floats.
  rng = np.random.default_rng(sum(shape) + k)
  x = rng.standard_normal(shape).astype(np.float32)
  x[..., ::7] = np.round(x[..., ::7])  # ties
  flat = x.reshape(-1, shape[-1])
  flat[0, :3] = [np.inf, -0.0, 0.0]
  flat[-1, : shape[-1] // 2] = -np.inf  # half the row -inf
  flat[-1, 1::5] = np.nan
  if flat.shape[0] > 2:
    flat[1, :] = np.float32(3.0)  # every score equal
    flat[2, :2] = [np.finfo(np.float32).max, np.finfo(np.float32).min]
  got = np.asarray(jax.jit(lambda x: kth_value.kth_largest(x, k, interpret=True))(jnp.asarray(x)))
  want = _want(x, k)
  np.testing.assert_array_equal(got, want)  # bit for bit (-inf included)
  assert np.signbit(got).tolist() == np.signbit(want).tolist()  # -0 vs +0


def test_kth_largest_refuses_a_k_outside_the_row():
  with pytest.raises(ValueError, match="1 <= k <= 4"):
    kth_value.kth_largest(jnp.zeros((2, 4)), 5)


def test_exact_selection_pallas_routes_the_threshold_and_the_mask_through_the_kernel(monkeypatch):
  # exact_selection "pallas" (backend.py): topk_threshold is the kernel's value and topk_mask generate_mask's over it
  # (the ties fix included): the same mask as the binned path's.
  calls = []
  real = kth_value.kth_largest
  monkeypatch.setattr(kth_value, "kth_largest", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
  rng = np.random.default_rng(3)
  x = jnp.asarray(np.round(rng.standard_normal((2, 3, 300)) * 4), jnp.float32)  # many ties
  with backend.forced(exact_selection="binned"):
    want_t, want_m = selection.topk_threshold(x, 40), selection.topk_mask(x, 40)
  with backend.forced(exact_selection="pallas"):
    got_t, got_m = selection.topk_threshold(x, 40), selection.topk_mask(x, 40)
  assert calls == [40, 40]
  np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
  np.testing.assert_array_equal(np.asarray(got_m), np.asarray(want_m))
  assert (np.asarray(got_m).sum(-1) == 40).all()


def test_a_training_step_differentiates_around_the_kernel():
  # The tpu row's exact selection in a differentiated function: the mask's threshold carries no gradient, and the
  # scores' gradient through the masked sum is the mask itself.
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 3, 64)), jnp.float32)
  with backend.forced(exact_selection="pallas"):
    g = jax.grad(lambda x: jnp.sum(jnp.where(selection.topk_mask(x, 8), x, 0.0)))(x)
    mask = selection.topk_mask(x, 8)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(mask, np.float32))


def test_on_a_mesh_of_several_devices_each_takes_its_own_rows():
  """Under logical_rules the kernel runs per shard (a Mosaic kernel is not partitioned by XLA): the same values."""
  from MaxText.runtime import sharding
  from tests.conftest import make_config
  cfg = make_config(num_devices=4, ici_fsdp_parallelism=2, ici_context_parallelism=2)
  mesh = sharding.create_mesh(cfg)
  scores = jax.random.normal(jax.random.PRNGKey(3), (4, 8, 300))  # [b,t,s]: b over fsdp, t over context
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    got = jax.jit(lambda x: kth_value.kth_largest(x, 17, interpret=True))(scores)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(scores, 17)[0][..., -1:]))
