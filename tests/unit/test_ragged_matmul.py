"""kernels/ragged_matmul.py: jax.lax.ragged_dot's values and gradients, unbatched and under vmap (folded into one
grouped product, no batch dimension), rows past the groups 0 with no gradient, an empty group, nested vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import ragged_matmul as rm
from tests.support.kernels import jaxpr_eqns

M, K, N, G = 12, 8, 5, 3
GROUPS = [[3, 0, 5], [4, 4, 4], [0, 0, 2]]  # rows 8..11 past the groups; an empty group; all rows in; most rows out


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  return f(3, M, K), f(3, G, K, N), jnp.asarray(GROUPS, jnp.int32), f(M, N)


def _loss(fn, w):
  return lambda lhs, rhs, gs: jnp.sum(fn(lhs, rhs, gs) * w)


def _ref(lhs, rhs, gs):
  return jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST)


def _mine(lhs, rhs, gs):
  return rm.matmul(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST)


def _per_problem(fn, *args):
  """fn on each problem of a leading batch, stacked (the reference for vmap)."""
  outs = [fn(*(a[b] for a in args)) for b in range(args[0].shape[0])]
  return jax.tree.map(lambda *x: jnp.stack(x), *outs)


def _close(got, want, tol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol * float(np.abs(w).max() or 1))


def test_values_and_gradients_equal_ragged_dots(case):
  lhs, rhs, gs, w = case
  for b in range(3):
    want = jax.value_and_grad(_loss(_ref, w), (0, 1))(lhs[b], rhs[b], gs[b])
    got = jax.value_and_grad(_loss(_mine, w), (0, 1))(lhs[b], rhs[b], gs[b])
    _close(got, want)
    out = np.asarray(_mine(lhs[b], rhs[b], gs[b]))
    assert (out[int(gs[b].sum()):] == 0).all()  # rows past the groups: 0 ...
    assert (np.asarray(got[1][0])[int(gs[b].sum()):] == 0).all()  # ... and no gradient
  assert np.abs(np.asarray(got[1][1])).max() > 0


def test_under_vmap_the_batch_folds_into_the_groups_with_each_problems_values_and_gradients(case):
  lhs, rhs, gs, w = case
  want = _per_problem(jax.value_and_grad(_loss(_ref, w), (0, 1)), lhs, rhs, gs)
  _close(jax.vmap(_mine)(lhs, rhs, gs), _per_problem(_ref, lhs, rhs, gs))
  _close(jax.vmap(jax.value_and_grad(_loss(_mine, w), (0, 1)))(lhs, rhs, gs), want)  # vmap of grad
  total = lambda lhs, rhs: jnp.sum(jax.vmap(_loss(_mine, w))(lhs, rhs, gs))  # noqa: E731
  _close(jax.grad(total, (0, 1))(lhs, rhs), want[1])  # grad of vmap (the pipeline's order)
  # an unbatched weight shared by every problem: its gradient the sum of each problem's
  shared = lambda lhs, rhs: jnp.sum(jax.vmap(_loss(_mine, w), (0, None, 0))(lhs, rhs, gs))  # noqa: E731
  each = _per_problem(lambda a, g: jax.grad(_loss(_ref, w), 1)(a, rhs[0], g), lhs, gs)  # [3,G,K,N]
  _close(jax.grad(shared, 1)(lhs, rhs[0]), each.sum(0))


def test_nested_vmap(case):
  lhs, rhs, gs, _ = case
  two = lambda a: jnp.stack([a, a[::-1]])  # noqa: E731
  got = jax.vmap(jax.vmap(_mine))(two(lhs), two(rhs), two(gs))
  _close(got, jnp.stack([_per_problem(_ref, lhs, rhs, gs), _per_problem(_ref, lhs[::-1], rhs[::-1], gs[::-1])]))


def test_the_vmapped_forward_and_backward_hold_no_batched_ragged_dot(case):
  """What XLA:TPU refuses ("number of batch dimensions should be 0"): jax's own rule would give every product of
  vmap(grad) a batch dimension; here the three (forward, d lhs, d rhs) have none."""
  lhs, rhs, gs, w = case
  jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(_loss(_mine, w), (0, 1))))(lhs, rhs, gs).jaxpr
  dots = [e.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[1] for e, _ in jaxpr_eqns(jaxpr)
          if e.primitive.name == "ragged_dot_general"]
  assert len(dots) == 3 and all(batch == ((), ()) for batch in dots), dots


def test_inside_a_shard_map_with_the_weight_split_and_the_rows_not_the_gradients_are_ragged_dots(case):
  """The tensor-parallel MoE: rows [M,K] the same on every device of `x` (not varying over it), the weight
  [G,K,N] split over x along N. d rows sums over x (each device's N slice contributes), as ragged_dot's autodiff
  makes it; the custom_vjp must return it so (the TPU row's 671B step with tensor 2 failed to trace without)."""
  from jax.sharding import PartitionSpec as P
  lhs, rhs, gs, w = case[0][1], case[1][1][..., :4], case[2][1], case[3][:, :4]  # N 4: split in 2
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

  def grads(fn):
    split = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(None, None, "x"), P()), out_specs=P(None, "x"))
    return jax.jit(jax.grad(_loss(split, w), argnums=(0, 1)))(lhs, rhs, gs)

  for got, want in zip(grads(_mine), grads(_ref)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads(_mine)[0], jax.grad(_loss(_ref, w))(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
