"""Expert parallelism on 8 simulated CPU devices: the MoE layer under shard_map with all-to-all
dispatch equals the single-device run (loss, every gradient, the routing-bias update) on expert,
data x expert, fsdp x expert x context and tensor x expert meshes; the capacity is cf x the mean
load rounded up; capacity drops are counted and are exactly the assignments a single-device
reference leaves out; the ragged exchange (GPU/TPU)
equals the fixed one; and the compiled program scales (memory per device, all-to-all present,
no token rows all-gathered or all-reduced)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import moe_dispatch
from MaxText.kernels.moe_experts import ExpertWeights
from MaxText.layers import moe
from MaxText.runtime import aot, sharding
from tests.conftest import make_config
from tests.support.sharded import (
  assert_same,
  layer_inputs,
  moe_on_mesh_of,
  moe_single_device,
  run_loss_and_grads,
  sigmoid_route_fn,
  small_config,
)

# data x expert: test_capacity_drops_are_counted_and_equal_a_reference_without_them and tests/integration/
# test_serving_mesh.py (kept out of here for CI's time)
MESHES = [dict(ici_expert_parallelism=8),
          dict(ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_context_parallelism=2),
          dict(ici_tensor_parallelism=2, ici_expert_parallelism=4)]


def _ep_config(**kw):
  base = dict(global_batch_size=8, ici_data_parallelism=1, moe_capacity_factor=-1.0, load_balance_loss_weight=0.01)
  base.update(kw)
  return small_config(**base)


@pytest.fixture(scope="module")
def single_device():
  return run_loss_and_grads(_ep_config(num_devices=1))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k[4:-12]}{v}" for k, v in m.items()))
def test_expert_parallel_equals_single_device(mesh, single_device):
  got = run_loss_and_grads(_ep_config(num_devices=math.prod(mesh.values()), **mesh))
  assert_same(got, single_device)
  assert got[3]["moe_dropped"] == 0.0  # dropless
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[3]["buffers"]),
                          jax.tree.leaves(single_device[3]["buffers"])):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))  # the bias step: +-rate or 0
  moved = [np.abs(b).max() for b in jax.tree.leaves(got[3]["buffers"])]
  assert max(moved) > 0  # the update happened (sign steps of the routing bias)


# ---------------------------------------------------------------- the layer alone: capacity, exchanges


def _kept_reference(ids, token_valid, ep, e, cap, token_shards):
  """numpy: which assignments the fixed-capacity dispatch keeps. Tokens split into `token_shards`
  equal consecutive shards of the flattened [b*t] order (batch-major, as the mesh shards them);
  in each shard, assignments in (token, slot) order, the first `cap` per owner device are kept."""
  ids = np.asarray(ids).reshape(-1, ids.shape[-1])  # [T,k]
  valid = np.broadcast_to(np.asarray(token_valid).reshape(-1, 1), ids.shape)
  kept = np.zeros(ids.shape, bool)
  per = ids.shape[0] // token_shards
  for s in range(token_shards):
    used = np.zeros(ep, int)
    for tok in range(s * per, (s + 1) * per):
      for j in range(ids.shape[1]):
        if valid[tok, j]:
          owner = ids[tok, j] // (e // ep)
          kept[tok, j] = used[owner] < cap
          used[owner] += 1
  return kept


@pytest.mark.parametrize("assignments,ep,capacity_factor,want", [
    (10, 4, 1.0, 3), (1000, 8, 1.25, 157), (64, 4, 1.1, 18), (64, 4, 1.0, 16),  # ceil(cf * M / ep)
    (3, 8, 1.0, 1), (10, 1, 2.0, 10), (10, 4, -1.0, 10)])  # at least 1, at most M; -1: dropless (M)
def test_capacity_is_cf_times_the_mean_load_rounded_up(assignments, ep, capacity_factor, want):
  assert moe_dispatch.capacity(assignments, ep, capacity_factor) == want


@pytest.mark.parametrize("mesh", [dict(ici_expert_parallelism=4), dict(ici_data_parallelism=2, ici_expert_parallelism=4)])
def test_capacity_drops_are_counted_and_equal_a_reference_without_them(mesh):
  b, t, d, e, k, i = 8, 16, 16, 8, 2, 8
  cf = 1.1  # cf x M / ep is not whole (17.6 and 8.8 rows): the bound's rounding shows
  cfg = make_config(num_devices=math.prod(mesh.values()), num_experts=e, **mesh)
  args = layer_inputs(b, t, d, e, i, skew=0.3)
  token_valid = jnp.ones((b, t), bool).at[:, -3:].set(False)  # padding: never routed nor counted
  y, counts, dropped = moe_on_mesh_of(cfg, args, token_valid, k, capacity_factor=cf, exchange="all_to_all")

  shards = math.prod(mesh.values())  # tokens over data x expert: consecutive blocks of the batch
  ep = mesh["ici_expert_parallelism"]
  _, ids = moe_single_device(args, k)
  cap = math.ceil(cf * (b * t // shards * k) / ep)  # rows each shard may send each owner (padding counts in M)
  kept = _kept_reference(ids, token_valid, ep, e, cap, shards)
  valid = np.broadcast_to(np.asarray(token_valid).reshape(-1, 1), kept.shape)
  assert int(dropped) == int((valid & ~kept).sum()) > 0
  np.testing.assert_array_equal(counts, np.bincount(np.asarray(ids)[valid], minlength=e))
  want, _ = moe_single_device(args, k, valid=jnp.asarray(kept))  # [T,D]
  np.testing.assert_allclose(np.asarray(y).reshape(b * t, d), want, rtol=1e-5, atol=1e-5)


def _ragged_all_to_all_by_all_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                     axis_name, axis_index_groups=None):
  """jax.lax.ragged_all_to_all's semantics from all_gather (XLA:CPU lacks the op): this device's
  output rows [output_offsets_s[me], +send_sizes_s[me]) come from source s's operand rows
  [input_offsets_s[me], ...)."""
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [ep,N,...]
  in_off, sizes, out_off = (jax.lax.all_gather(v, axis_name)[:, me] for v in
                            (input_offsets, send_sizes, output_offsets))  # [ep] per source
  rows = jnp.arange(output.shape[0])
  for s in range(ops.shape[0]):
    inside = (rows >= out_off[s]) & (rows < out_off[s] + sizes[s])  # [O]
    src = jnp.clip(in_off[s] + rows - out_off[s], 0, ops.shape[1] - 1)  # [O]
    output = jnp.where(inside.reshape((-1,) + (1,) * (output.ndim - 1)), ops[s][src], output)
  return output


@pytest.mark.parametrize("capacity_factor", [-1.0, 1.0])
def test_ragged_exchange_equals_fixed_exchange(capacity_factor, monkeypatch):
  b, t, d, e, k, i = 8, 8, 16, 8, 2, 8
  cfg = make_config(num_devices=8, num_experts=e, ici_data_parallelism=2, ici_expert_parallelism=4)
  args = layer_inputs(b, t, d, e, i, skew=0.3)
  token_valid = jnp.ones((b, t), bool).at[0, :5].set(False)
  fixed = moe_on_mesh_of(cfg, args, token_valid, k, capacity_factor=capacity_factor, exchange="all_to_all")
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_all_gather)
  ragged = moe_on_mesh_of(cfg, args, token_valid, k, capacity_factor=capacity_factor, exchange="ragged_all_to_all")
  np.testing.assert_allclose(ragged[0], fixed[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(ragged[1], fixed[1])
  assert int(ragged[2]) == int(fixed[2]) == (0 if capacity_factor < 0 else int(fixed[2]))
  if capacity_factor > 0:
    assert int(fixed[2]) > 0


def test_tokens_replicated_over_expert_run_local_experts_and_psum():
  # One sequence cannot be split over 4 expert devices: each runs its own experts on all tokens.
  b, t, d, e, k, i = 1, 8, 16, 8, 2, 8
  cfg = make_config(num_devices=4, num_experts=e, ici_expert_parallelism=4)
  args = layer_inputs(b, t, d, e, i, skew=0.0)
  y, counts, dropped = moe_on_mesh_of(cfg, args, jnp.ones((b, t), bool), k, capacity_factor=-1.0, exchange="all_to_all")
  want, ids = moe_single_device(args, k)
  np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(counts, np.bincount(np.asarray(ids).reshape(-1), minlength=e))
  assert int(dropped) == 0


# ---------------------------------------------------------------- scaling, from the compiled program

D, E, K, I = 64, 8, 2, 64


def _compiled_layer_grad(n: int, tokens_per_seq: int, batch: int):
  """The MoE layer's forward + backward (x and every weight) on n devices, every device on the
  expert axis (tokens sharded over it too; capacity factor 1.25), compiled from abstract inputs."""
  cfg = make_config(num_devices=n, num_experts=E, num_experts_per_tok=K, n_routing_groups=1, topk_routing_group=1,
                    emb_dim=D, moe_mlp_dim=I, ici_expert_parallelism=n, moe_capacity_factor=1.25)
  mesh = sharding.create_mesh(cfg, jax.devices()[:n])

  def loss(layer_state, graphdef, x):
    y, aux = nnx.merge(graphdef, layer_state)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(aux["expert_load"])

  with mesh, sharding.logical_rules(cfg, mesh):
    graphdef, state = aot.abstract_module(lambda: moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(0)), cfg, mesh)
    x = aot.abstract_array((batch, tokens_per_seq, D), jnp.float32,
                           ("activation_batch", "activation_length", "activation_embed"), cfg, mesh)
    return jax.jit(jax.grad(loss, argnums=(0, 2)), static_argnums=1).lower(state, graphdef, x).compile()


@pytest.fixture(scope="module")
def scaling():
  t_per_device = 512  # tokens per device: 8 sequences of 64
  weak = {n: _compiled_layer_grad(n, 64, 8 * n) for n in (1, 8)}
  strong8 = _compiled_layer_grad(8, 64, 8)  # the 1-device batch spread over 8 (one sequence each)
  return t_per_device, weak, strong8


def test_weak_and_strong_scaling_of_per_device_memory(scaling):
  _, weak, strong8 = scaling
  temp = {n: c.memory_analysis().temp_size_in_bytes for n, c in weak.items()}
  assert temp[8] <= 1.3 * temp[1], temp  # fixed tokens per device: flat
  strong = strong8.memory_analysis().temp_size_in_bytes
  assert strong * 4 <= temp[1], (strong, temp[1])  # fixed global tokens: falls >= 4x from 1 to 8 devices


def test_hlo_has_all_to_all_and_no_token_row_all_gather_or_all_reduce(scaling):
  t_per_device, weak, _ = scaling
  hlo = weak[8].as_text()
  assert aot.collective_sizes(hlo, "all-to-all"), "no all-to-all in the expert-parallel program"
  token_rows = t_per_device * D  # one [T_l, D] block of token rows; [T*k, D] is K times that
  for op in ("all-gather", "all-reduce"):
    big = [s for s in aot.collective_sizes(hlo, op) if s >= token_rows]
    assert not big, f"{op} of token rows: {big} elements (>= {token_rows})"


# ---------------------------------------------------------------- serving


def _serve(mesh_kw, prompts):
  """The serving engine on a mesh: the greedy tokens of `prompts` served together, and the pools after."""
  from MaxText.checkpoint import model_state
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  cfg = small_config(num_devices=math.prod(mesh_kw.values()), ici_data_parallelism=1, mtp_num_layers=0,
                     param_init_std=0.2, max_prefill_length=24, serve_page_size=8, serve_max_num_seqs=4,
                     serve_max_num_tokens=32, **mesh_kw)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    written = {}
    def record(r):  # the slots of each request's written positions, before its pages are released
      ps = eng.page_size
      written[id(r)] = [r.pages[i // ps] * ps + i % ps for i in range(r.computed)]
    eng.scheduler.on_finish = record
    out = eng.generate(prompts, SamplingParams(max_tokens=4))
    # the pools as each request's entries in position order (a mesh shards pages, so page ids differ)
    pools = [jax.tree.map(lambda a, s=written[id(r)]: np.asarray(a)[..., s, :], eng.pools) for r in out]
    return [r.output for r in out], pools


def test_serving_runs_expert_parallel():
  # Two prompts: on expert=2 the batch shards over `expert` (all-to-all dispatch); on expert=4 it
  # cannot, and each device runs its own experts on both rows (psum over `expert`). Tokens and
  # each request's cache entries equal one device's.
  prompts = [list(range(3, 20)), list(range(7, 12))]  # ragged
  want = _serve({}, prompts)
  for mesh in (dict(ici_expert_parallelism=2), dict(ici_expert_parallelism=4)):
    got = _serve(mesh, prompts)
    assert got[0] == want[0], mesh
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_ragged_exchange_lowers_with_its_gradient():
  # XLA:CPU cannot compile ragged-all-to-all, but the program GPU/TPU run lowers here, its backward
  # pass included.
  b, t, d, e, k, i = 8, 8, 16, 8, 2, 8
  cfg = make_config(num_devices=8, num_experts=e, ici_data_parallelism=2, ici_expert_parallelism=4)
  mesh, rules = sharding.create_mesh(cfg), sharding.rules_of(cfg)
  args = layer_inputs(b, t, d, e, i, skew=0.3)

  def loss(x, wi_0, wi_1, wo):
    y = moe_dispatch.moe_on_mesh(x, jnp.ones((b, t), bool), args[1], args[2], ExpertWeights(wi_0, wi_1, wo),
                                 route_fn=sigmoid_route_fn(k), mesh=mesh, rules=rules, capacity_factor=-1.0,
                                 exchange="ragged_all_to_all", impl="blocked", balance=False).y
    return jnp.sum(y ** 2)

  fwd = jax.jit(loss).lower(args[0], *args[3:]).as_text()
  assert fwd.count("ragged_all_to_all") == 3  # rows and their expert ids there, outputs back
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(args[0], *args[3:]).as_text()
  assert grad.count("ragged_all_to_all") == 5  # + the transposes of the two float exchanges


def test_fsdp_sharded_expert_weights_are_gathered_inside_and_their_gradients_reduce_scattered():
  """fsdp 4 x expert 2: each device's local experts' weights arrive split over fsdp (D/4) and are all_gathered in
  the shard_map; the gradient goes back by a reduce-scatter of [E_l, D/4, I], never an all-reduce of the whole
  [E_l, D, I] (what GSPMD's gather before the shard_map gave: 98 GiB a chip a step on the 671B)."""
  import re

  from flax import nnx
  cfg = make_config(num_devices=8, num_experts=E, num_experts_per_tok=K, n_routing_groups=1, topk_routing_group=1,
                    emb_dim=D, moe_mlp_dim=I, ici_data_parallelism=1, ici_fsdp_parallelism=4, ici_expert_parallelism=2,
                    moe_capacity_factor=1.25, moe_exchange="all_to_all")
  mesh = sharding.create_mesh(cfg)

  def loss(layer_state, graphdef, x):
    y, _ = nnx.merge(graphdef, layer_state)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  with mesh, sharding.logical_rules(cfg, mesh):
    graphdef, state = aot.abstract_module(lambda: moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(0)), cfg, mesh)
    x = aot.abstract_array((8, 16, D), jnp.float32, ("activation_batch", "activation_length", "activation_embed"),
                           cfg, mesh)
    hlo = jax.jit(jax.grad(loss), static_argnums=1).lower(state, graphdef, x).compile().as_text()
  whole = {(E // 2, D, I), (E // 2, I, D)}  # a device's experts, D whole
  for op in ("all-reduce", "reduce-scatter"):
    shapes = [tuple(int(v) for v in dims.split(",") if v) for line in hlo.splitlines()
              if re.search(rf"\s{op}(-start)?\(", line)
              for dims in re.findall(r"\[([\d,]*)\]", line.split("=", 1)[1].split(f" {op}")[0])]
    if op == "all-reduce":
      assert not whole & set(shapes), shapes
    else:
      assert {(E // 2, D // 4, I), (E // 2, I, D // 4)} <= set(shapes), shapes
