"""Shared by the sharded-equals-single-device tests: a small model config, one loss + gradient
evaluation on a config's mesh, and the comparison; the MoE layer alone on a mesh and on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.data import input_pipeline
from MaxText.kernels import moe_dispatch, moe_experts
from MaxText.kernels.moe_experts import ExpertWeights
from MaxText.layers import moe
from MaxText.runtime import sharding
from tests.conftest import make_config

T = 32


def small_config(**kw):
  # 1 dense + 1 MoE layer + MTP, no remat: every piece is exercised at the lowest compile cost.
  base = dict(max_target_length=T, max_prefill_length=8, global_batch_size=4, mtp_num_layers=1,
              num_decoder_layers=2, first_num_dense_layers=1, remat_policy="none",
              indexer_topk=8, indexer_n_heads=16, matmul_precision="highest")
  base.update(kw)
  return make_config(**base)


def run_loss_and_grads(cfg, edit_params=None):
  """(loss, lm_loss, grads, {metrics..., "buffers": routing biases after the step's update}) of one
  batch on cfg's mesh; edit_params(params) -> params before the step."""
  mesh = sharding.create_mesh(cfg)
  with mesh, sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    if edit_params is not None:
      params = edit_params(params)
    raw = next(input_pipeline.create_data_iterator(cfg))
    batch = train.prepare_batch(cfg, raw)
    batch = jax.device_put(batch, train.batch_shardings(cfg, mesh, batch))

    def loss(p):
      total, (metrics, loads) = train.lm_loss_fn(cfg, graphdef, p, buffers, batch)
      return total, (metrics, train.update_routing_biases(cfg, buffers, loads))

    (total, (metrics, new_buffers)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    extra = {k: float(v) for k, v in metrics.items()}
    extra["buffers"] = jax.tree.map(np.asarray, new_buffers)
    return float(total), float(metrics["lm_loss"]), jax.tree.map(np.asarray, grads), extra


def assert_same(got, want):
  assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
  assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- the MoE layer alone


def layer_inputs(b, t, d, e, i, skew, seed=0):
  """x [b,t,D], gate [D,E], bias [E] (`skew` steers tokens to the first experts), wi_0/wi_1 [E,D,I], wo [E,I,D]."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  x = jax.random.normal(ks[0], (b, t, d))
  gate = jax.random.normal(ks[1], (d, e)) * d ** -0.5
  bias = -skew * jnp.arange(e, dtype=jnp.float32)  # [E]
  wi_0 = jax.random.normal(ks[3], (e, d, i)) * d ** -0.5
  wi_1 = jax.random.normal(ks[4], (e, d, i)) * d ** -0.5
  wo = jax.random.normal(ks[5], (e, i, d)) * i ** -0.5
  return x, gate, bias, wi_0, wi_1, wo


def sigmoid_route_fn(k):
  routing = moe.Routing(num_experts_per_tok=k, n_routing_groups=1, topk_routing_group=1, routed_score_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=1.0)
  return lambda x, gate, bias: moe.route(jnp.dot(x, gate, precision="highest"), bias, routing)


def moe_on_mesh_of(cfg, args, token_valid, k, **kw):
  mesh = sharding.create_mesh(cfg)
  rules = sharding.rules_of(cfg)
  def f(x, token_valid, gate, bias, *experts):
    r = moe_dispatch.moe_on_mesh(x, token_valid, gate, bias, ExpertWeights(*experts), route_fn=sigmoid_route_fn(k), mesh=mesh,
                                 rules=rules, impl="blocked", balance=False, **kw)
    return r.y, r.counts, r.dropped
  return jax.jit(f)(args[0], token_valid, *args[1:])


def moe_single_device(args, k, valid=None):
  """(y [T,D], ids [T,k]) on one device, leaving out assignments where valid [T,k] is False."""
  x, gate, bias, wi_0, wi_1, wo = args
  xf = x.reshape(-1, x.shape[-1])  # [T,D]
  weights, ids, _ = sigmoid_route_fn(k)(xf, gate, bias)
  return moe_experts.weighted_experts(xf, weights, ids, ExpertWeights(wi_0, wi_1, wo), impl="blocked", valid=valid), ids
