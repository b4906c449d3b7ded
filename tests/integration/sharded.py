"""Shared by the sharded-equals-single-device tests: a small model config, one loss + gradient
evaluation on a config's mesh, and the comparison."""

import jax
import numpy as np
import pytest

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.data import input_pipeline
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
      total, (metrics, loads) = train._loss_fn(cfg, graphdef, p, buffers, batch)
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
