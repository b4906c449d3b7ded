"""Keep routing (RL, DeepSeek-V3.2 sec. 3.1): an MoE layer given recorded experts takes them, gate weights
from the current router. Forcing the experts the layer chose itself changes nothing (outputs and
gradients, one device and a data x expert mesh); forcing others changes the output and gives the
weights of THOSE experts' scores, normalized as route() does; -1 routes a token freely."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import make_config

from MaxText.checkpoint import model_state
from MaxText.layers import moe
from MaxText.runtime import sharding

route = jax.jit(moe.route, static_argnames=("routing",))
TINY = dict(num_decoder_layers=3, first_num_dense_layers=1, mtp_num_layers=0, param_init_std=0.2,
            matmul_precision="highest", remat_policy="none")


def test_forced_route_takes_the_given_experts_with_this_routers_normalized_scores():
  routing = moe.Routing(num_experts_per_tok=2, n_routing_groups=2, topk_routing_group=1, routed_score_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=2.5)
  logits = jax.random.normal(jax.random.key(0), (5, 8))  # [T,E]
  w, ids, scores = route(logits, None, routing)
  w_same, ids_same, _ = route(logits, None, routing, ids)
  np.testing.assert_array_equal(ids_same, ids)
  np.testing.assert_array_equal(w_same, w)
  forced = np.array([[7, 0], [1, 2], [-1, -1], [3, 4], [5, 6]], np.int32)  # token 2: not recorded
  w_f, ids_f, _ = route(logits, None, routing, jnp.asarray(forced))
  want_ids = forced.copy()
  want_ids[2] = np.asarray(ids)[2]
  np.testing.assert_array_equal(ids_f, want_ids)
  s = np.take_along_axis(np.asarray(scores, np.float64), want_ids, axis=-1)  # [T,k]
  np.testing.assert_allclose(w_f, 2.5 * s / s.sum(-1, keepdims=True), rtol=1e-6)


def _forced_vs_free(cfg):
  """One program (one compile): the free forward and gradients, the same forced with the routing it
  chose, and the forward forced with other experts -> (free logits, routing, its grads, forced logits,
  routing, grads, logits and routing forced with others)."""
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)

    def loss(p, tokens, routed):
      logits, aux = model_state.merge(graphdef, p, buffers)(tokens, routed_experts=routed)
      return jnp.sum(jnp.sin(logits)), (logits, aux["routed_experts"])  # [b,t,V], [b,t,L,k]

    grad = jax.value_and_grad(loss, has_aux=True)

    @jax.jit
    def run(p, tokens):
      (_, (free, ids)), g_free = grad(p, tokens, None)
      (_, (same, ids_same)), g_same = grad(p, tokens, ids)
      other = (ids + 1) % cfg.num_experts  # [b,t,L,k]: other experts, still distinct per token
      _, (moved, ids_moved) = loss(p, tokens, other)
      return free, ids, g_free, same, ids_same, g_same, moved, ids_moved, other

    out = run(params, jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size))
  return jax.tree.map(np.asarray, out)


def _check(cfg):
  free, ids, g_free, same, ids_same, g_same, moved, ids_moved, other = _forced_vs_free(cfg)
  assert ids.shape == (4, 8, cfg.num_moe_layers, cfg.num_experts_per_tok)
  np.testing.assert_array_equal(ids_same, ids)
  np.testing.assert_array_equal(ids_moved, other)
  np.testing.assert_allclose(same, free, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_same, g_free)
  router = g_free["moe_layers"]["layers"]["mlp"]["gate_kernel"]
  assert np.abs(router).max() > 0  # gradients reach the router through the gate weights
  assert np.abs(moved - free).max() > 1e-3
  return ids


def test_forcing_the_chosen_experts_keeps_outputs_and_gradients_on_one_device_and_a_mesh():
  single = _check(make_config(**TINY))
  meshed = _check(make_config(num_devices=8, ici_data_parallelism=2, ici_expert_parallelism=4, **TINY))
  np.testing.assert_array_equal(meshed, single)  # the mesh's dispatch returns the same routing
