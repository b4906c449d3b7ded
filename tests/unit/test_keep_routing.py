"""Keep routing (RL, DeepSeek-V3.2 sec. 3.1): an MoE layer given recorded experts takes them, gate weights
from the current router. Forcing the experts the layer chose itself changes nothing (outputs and
gradients, one device and a data x expert mesh); forcing others changes the output and gives the
weights of THOSE experts' scores, normalized as route() does; -1 routes a token freely."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.layers import moe
from MaxText.runtime import sharding
from tests.support.moe import ROUTE_CFG, make_model, np_route, params64, rand_x

route = jax.jit(moe.route, static_argnames=("routing",))


def test_forced_route_takes_the_given_experts_with_this_routers_normalized_scores():
  routing = moe.Routing(num_experts_per_tok=2, n_routing_groups=2, topk_routing_group=1, routed_score_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=2.5)
  logits = jax.random.normal(jax.random.key(0), (5, 8))  # [T,E]
  w, ids, scores = route(logits, None, routing)
  w_same, ids_same, _ = route(logits, None, routing, ids)
  np.testing.assert_array_equal(ids_same, ids)
  np.testing.assert_array_equal(w_same, w)
  routed = np.array([[7, 0], [1, 2], [-1, -1], [3, 4], [5, 6]], np.int32)  # token 2: not recorded
  w_f, ids_f, _ = route(logits, None, routing, jnp.asarray(routed))
  want_ids = routed.copy()
  want_ids[2] = np.asarray(ids)[2]
  np.testing.assert_array_equal(ids_f, want_ids)
  s = np.take_along_axis(np.asarray(scores, np.float64), want_ids, axis=-1)  # [T,k]
  np.testing.assert_allclose(w_f, 2.5 * s / s.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("mesh", [{}, dict(ici_data_parallelism=2, ici_expert_parallelism=4)],
                         ids=["one_device", "data2xexpert4"])
def test_forcing_the_chosen_experts_keeps_outputs_and_gradients_forcing_others_changes_them(mesh):
  # one program (one compile) per case: free forward + gradients, the same forced with the routing the
  # layer chose, the forward forced with other experts; on the mesh through the expert-parallel dispatch
  exchange = dict(moe_exchange="all_to_all") if mesh and jax.default_backend() == "cpu" else {}
  cfg, model = make_model(**ROUTE_CFG, num_devices=8 if mesh else 1, **mesh, **exchange)
  x = rand_x(cfg, b=4)  # [4,8,D]
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, routed_experts):
    y, aux = nnx.merge(graphdef, p, rest)(x, None, routed_experts=routed_experts)  # [b,t,D]
    return jnp.sum(jnp.sin(y)), (y, aux["routed_experts"])  # aux: [b,t,k]

  grad = jax.value_and_grad(loss, has_aux=True)

  @jax.jit
  def run(p):
    (_, (free, ids)), g_free = grad(p, None)
    (_, (same, ids_same)), g_same = grad(p, ids)
    other = (ids + 1) % cfg.num_experts  # [b,t,k]: other experts, still distinct per token
    _, (moved, ids_moved) = loss(p, other)
    return free, ids, g_free, same, ids_same, g_same, moved, ids_moved, other

  with sharding.logical_rules(cfg, sharding.create_mesh(cfg)) if mesh else contextlib.nullcontext():
    free, ids, g_free, same, ids_same, g_same, moved, ids_moved, other = jax.tree.map(np.asarray, run(params))
  _, want_ids, _ = np_route(np.asarray(x, np.float64).reshape(-1, cfg.emb_dim) @ params64(model)["gate"],
                            np.zeros(cfg.num_experts), cfg)
  np.testing.assert_array_equal(np.sort(ids.reshape(want_ids.shape), -1), np.sort(want_ids, -1))  # as route() chose
  np.testing.assert_array_equal(ids_same, ids)
  np.testing.assert_array_equal(ids_moved, other)
  np.testing.assert_allclose(same, free, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_same, g_free)
  assert np.abs(g_free["gate_kernel"]).max() > 0  # gradients reach the router through the gate weights
  assert np.abs(moved - free).max() > 1e-3
