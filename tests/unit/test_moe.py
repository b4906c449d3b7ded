"""DeepSeekMoE: routing, dropless dispatch, the whole layer, gradients and balancing.

Oracles: float64 numpy loops written from the paper (routing, the layer, the balance loss),
Hugging Face's DeepseekV32TopkRouter / DeepseekV32MoE with the same weights, and a dense
all-experts jnp einsum for gradients.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import moe_experts
from MaxText.layers import moe
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.moe import ROUTE_CFG, make_model, np_moe, np_route, np_swiglu, params64, rand_x, randn, rel_err
from tests.support.precision import f32_rtol

pytestmark = pytest.mark.device  # runs unchanged on one GPU or TPU (tools/device/device_check.sh)


# jitted entry points: one compile per config instead of one per eager op
route = jax.jit(moe.route, static_argnames=("routing",))
apply = nnx.jit(lambda model, x: model(x))


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("overrides", [
    dict(ROUTE_CFG),
    dict(ROUTE_CFG, norm_topk_prob=False, routed_scaling_factor=1.0),
    dict(ROUTE_CFG, routed_score_func="softmax"),
    dict(ROUTE_CFG, n_routing_groups=1, topk_routing_group=1),
    dict(num_experts=8, n_routing_groups=8, topk_routing_group=3, num_experts_per_tok=3),  # 1 expert/group
])
def test_route_matches_numpy_oracle(overrides):
  cfg = make_config(**overrides)
  logits = randn((32, cfg.num_experts), 0, 2.0)
  bias = randn((cfg.num_experts,), 1, 0.3)
  for b in (None, bias):
    w, ids, s = route(logits, b, moe.Routing.of(cfg))
    w_ref, ids_ref, s_ref = np_route(logits, b, cfg)
    np.testing.assert_array_equal(np.asarray(ids), ids_ref)  # both sort by descending score
    np.testing.assert_allclose(w, w_ref, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32


def test_bias_changes_selection_but_weights_stay_unbiased_scores():
  cfg = make_config(**ROUTE_CFG)
  logits = randn((64, 16), 0, 2.0)
  bias = jnp.zeros(16).at[jnp.array([0, 5, 11])].set(0.6)
  w0, ids0, _ = route(logits, None, moe.Routing.of(cfg))
  w, ids, s = route(logits, bias, moe.Routing.of(cfg))
  assert np.mean(np.asarray(ids0) != np.asarray(ids)) > 0.1  # the bias moved many selections
  chosen = np.take_along_axis(np.asarray(s), np.asarray(ids), -1)  # unbiased scores at the chosen experts
  np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)
  biased = chosen + np.asarray(bias)[np.asarray(ids)]
  assert not np.allclose(w, biased / biased.sum(-1, keepdims=True) * 2.5, rtol=1e-3)


def test_group_limit_keeps_experts_inside_the_best_groups():
  cfg = make_config(**ROUTE_CFG)  # 4 groups of 4, 2 kept, k=4
  # group 0 holds the single best expert but group 1 and 2 have the best top-2 sums
  logits = jnp.array([[5., -9, -9, -9, 3, 3, -9, -9, 2.9, 2.9, -9, -9, 1, 1, 1, 1]])
  _, ids, _ = route(logits, None, moe.Routing.of(cfg))
  assert set(np.asarray(ids[0]).tolist()) == {4, 5, 8, 9}


def _hf_config(cfg):
  from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
  hf = DeepseekV32Config(
      hidden_size=cfg.emb_dim, n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_mlp_dim,
      n_shared_experts=cfg.shared_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      n_group=cfg.n_routing_groups, topk_group=cfg.topk_routing_group, norm_topk_prob=cfg.norm_topk_prob,
      routed_scaling_factor=cfg.routed_scaling_factor, hidden_act="silu")
  hf._experts_implementation = "eager"
  return hf


def _t(a):
  import torch
  return torch.tensor(np.asarray(a, np.float32))


def test_route_matches_hf_topk_router():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter
  cfg, model = make_model(**ROUTE_CFG)
  model.routing_bias[...] = randn((16,), 3, 0.3)
  x = rand_x(cfg).reshape(-1, cfg.emb_dim)
  router = DeepseekV32TopkRouter(_hf_config(cfg))
  with torch.no_grad():
    router.weight.copy_(_t(model.gate_kernel[...].T))  # [E,D]
    router.e_score_correction_bias.copy_(_t(model.routing_bias[...]))
    _, w_hf, ids_hf = router(_t(x))
  logits = x @ model.gate_kernel[...]
  w, ids, _ = route(logits, model.routing_bias[...], moe.Routing.of(cfg))
  w_hf, ids_hf = w_hf.numpy(), ids_hf.numpy()
  for t in range(x.shape[0]):  # HF's top-k is unsorted: compare as sets, weights matched by expert
    assert set(ids[t].tolist()) == set(ids_hf[t].tolist())
    hf_by_expert = dict(zip(ids_hf[t].tolist(), w_hf[t].tolist()))
    np.testing.assert_allclose(np.asarray(w[t]), [hf_by_expert[e] for e in ids[t].tolist()], rtol=1e-5)


# ---------------------------------------------------------------- dispatch


@pytest.mark.parametrize("block_rows", [1, 4, 8])
def test_dispatch_plan_places_every_assignment_in_its_experts_block(block_rows):
  ids = np.random.default_rng(0).integers(0, 8, (24, 3))
  ids[:10, 0] = 5  # one expert crowded
  plan = jax.jit(moe_experts.plan_dispatch, static_argnums=(1, 2))(jnp.asarray(ids, jnp.int32), 8, block_rows)
  flat = np.asarray(ids).reshape(-1)
  rows = np.asarray(plan.row_of_assignment)
  assert len(set(rows.tolist())) == flat.size  # one row per assignment
  np.testing.assert_array_equal(np.asarray(plan.token_of_row)[rows], np.arange(flat.size) // 3)
  np.testing.assert_array_equal(np.asarray(plan.block_expert)[rows // block_rows], flat)
  assert int(plan.row_valid.sum()) == flat.size and bool(np.all(np.asarray(plan.row_valid)[rows]))
  np.testing.assert_array_equal(plan.group_sizes, np.bincount(flat, minlength=8))


@pytest.mark.parametrize("impl,block_rows", [("ragged_dot", None), ("blocked", None), ("blocked", 4)])
def test_weighted_experts_impls_match_token_loop(impl, block_rows):
  cfg, model = make_model(shared_experts=0)
  x = rand_x(cfg).reshape(-1, cfg.emb_dim)
  p = params64(model)
  w, ids, _ = np_route(np.asarray(x, np.float64) @ p["gate"], None, cfg)
  experts = jax.jit(moe_experts.weighted_experts, static_argnames=("impl", "block_rows"))
  y = experts(x, jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32),
              moe_experts.ExpertWeights(model.wi_0[...], model.wi_1[...], model.wo[...]), impl=impl,
              block_rows=block_rows)
  y_ref = np.stack([sum(wj * np_swiglu(np.asarray(x[t], np.float64), p["wi_0"][e], p["wi_1"][e], p["wo"][e])
                        for wj, e in zip(w[t], ids[t])) for t in range(x.shape[0])])
  assert rel_err(y, y_ref) <= f32_rtol(1e-5)


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("dispatch,overrides", [
    ("blocked", {}), ("blocked", dict(ROUTE_CFG, shared_experts=2)), ("blocked", dict(shared_experts=0)),
    ("ragged_dot", dict(ROUTE_CFG, shared_experts=2))])
def test_layer_matches_token_loop_oracle(dispatch, overrides):
  cfg, model = make_model(**overrides)
  model.dispatch = dispatch
  if model.routing_bias is not None:
    model.routing_bias[...] = randn((cfg.num_experts,), 7, 0.2)
  x = rand_x(cfg)
  y, _ = apply(model, x)
  y_ref, _ = np_moe(x, params64(model), cfg)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert rel_err(y, y_ref) <= f32_rtol(1e-5)


def test_layer_matches_hf_deepseek_v32_moe():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32MoE
  cfg, model = make_model(**ROUTE_CFG)
  model.routing_bias[...] = randn((16,), 3, 0.2)
  hf = DeepseekV32MoE(_hf_config(cfg))
  tr = lambda a: np.swapaxes(np.asarray(a), -1, -2)
  with torch.no_grad():
    hf.gate.weight.copy_(_t(model.gate_kernel[...].T))  # [E,D]
    hf.gate.e_score_correction_bias.copy_(_t(model.routing_bias[...]))
    hf.experts.gate_up_proj.copy_(_t(np.concatenate([tr(model.wi_0[...]), tr(model.wi_1[...])], 1)))  # [E,2I,D]
    hf.experts.down_proj.copy_(_t(tr(model.wo[...])))  # [E,D,I]
    se = model.shared_experts
    hf.shared_experts.gate_proj.weight.copy_(_t(se.gate.kernel[...].T))
    hf.shared_experts.up_proj.weight.copy_(_t(se.up.kernel[...].T))
    hf.shared_experts.down_proj.weight.copy_(_t(se.down.kernel[...].T))
    x = rand_x(cfg)
    y_hf = hf(_t(x)).numpy()
  y, _ = apply(model, x)
  assert rel_err(y, y_hf) <= f32_rtol(1e-5)


@pytest.mark.parametrize("k,forced", [(1, [3]), (2, [2, 3])])
def test_dropless_when_every_token_picks_the_same_experts(k, forced):
  cfg, model = make_model(num_experts_per_tok=k)
  model.routing_bias[...] = jnp.zeros(cfg.num_experts).at[jnp.array(forced)].set(100.0)
  x = rand_x(cfg, b=2, t=16)
  y, aux = apply(model, x)
  y_ref, ids_ref = np_moe(x, params64(model), cfg)
  assert sorted(set(ids_ref.reshape(-1).tolist())) == forced
  expect = np.zeros(cfg.num_experts)
  expect[forced] = 1.0 / k
  np.testing.assert_allclose(aux["expert_load"], expect)
  assert rel_err(y, y_ref) <= f32_rtol(1e-5)  # all 32 tokens through one expert: nothing dropped


def test_layer_under_jit_and_bf16():
  cfg32, m32 = make_model(dtype="float32", weight_dtype="float32")
  cfg16, m16 = make_model(dtype="bfloat16", weight_dtype="bfloat16")
  for v32, v16 in zip(nnx.to_flat_state(nnx.state(m32, nnx.Param)), nnx.to_flat_state(nnx.state(m16, nnx.Param))):
    v32[1][...] = v16[1][...].astype(jnp.float32)  # same (bf16-representable) weights
  x = rand_x(cfg16).astype(jnp.bfloat16)
  y16, aux16 = apply(m16, x)
  y32, aux32 = apply(m32, x.astype(jnp.float32))
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(aux16["expert_load"], aux32["expert_load"])  # router is fp32 in both
  assert rel_err(y16, y32) < 2e-2


def test_parameters_and_logical_axes():
  cfg = make_config()
  model = moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(0))
  e, d, i = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim
  expect = {"gate_kernel": ((d, e), ("embed", "exp")), "wi_0": ((e, d, i), ("exp", "embed", "mlp")),
            "wi_1": ((e, d, i), ("exp", "embed", "mlp")), "wo": ((e, i, d), ("exp", "mlp", "embed"))}
  for name, (shape, axes) in expect.items():
    var = getattr(model, name)
    assert isinstance(var, nnx.Param) and var.shape == shape and var.logical_axes == axes
  assert model.routing_bias.logical_axes == ("exp",) and model.routing_bias[...].dtype == jnp.float32
  np.testing.assert_array_equal(model.routing_bias[...], np.zeros(e))
  assert 0.5 * cfg.param_init_std < float(jnp.std(model.wi_0[...])) < 2 * cfg.param_init_std


# ---------------------------------------------------------------- gradients


def _dense_reference(p, x, ids, cfg):
  """All experts for all tokens, masked by the (fixed) selection: the gradient oracle."""
  s = jax.nn.sigmoid(x @ p["gate_kernel"])  # [T,E]
  mask = jax.nn.one_hot(ids, cfg.num_experts).sum(1)  # [T,E]
  g = s * mask
  g = g / (g.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor  # [T,E]
  h = jax.nn.silu(jnp.einsum("td,edi->tei", x, p["wi_0"])) * jnp.einsum("td,edi->tei", x, p["wi_1"])  # [T,E,I]
  out = jnp.einsum("tei,eid->ted", h, p["wo"])  # [T,E,D]
  return jnp.einsum("te,ted->td", g, out)  # [T,D]


@pytest.mark.parametrize("dispatch", ["blocked", "blocked_loop", "ragged_dot"])
def test_gradients_match_dense_oracle_and_float64_finite_differences(dispatch, monkeypatch):
  if dispatch == "blocked_loop":  # the blocks run in a loop reading weights in place (large layers)
    monkeypatch.setattr(moe_experts, "BLOCK_WEIGHT_COPY_LIMIT", 0)
    dispatch = "blocked"
  cfg, model = make_model(shared_experts=0)
  model.dispatch = dispatch
  x = rand_x(cfg)
  r = randn(x.shape, 9)  # loss = <y, r>
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y * r)

  grads = jax.jit(jax.grad(loss))(params)
  p = {n: getattr(model, n)[...] for n in ("gate_kernel", "wi_0", "wi_1", "wo")}
  xf = x.reshape(-1, cfg.emb_dim)
  _, ids, _ = route(xf @ p["gate_kernel"], model.routing_bias[...], moe.Routing.of(cfg))
  dense_grads = jax.jit(jax.grad(lambda p: jnp.sum(_dense_reference(p, xf, ids, cfg) * r.reshape(xf.shape))))(p)

  p64 = params64(model)
  r64 = np.asarray(r, np.float64)
  for name, key in (("gate_kernel", "gate"), ("wi_0", "wi_0"), ("wo", "wo")):
    g = np.asarray(grads[name][...])
    assert rel_err(g, dense_grads[name]) <= f32_rtol(1e-5), name
    # central difference of the float64 token-loop oracle along a random direction
    v = np.random.default_rng(len(name)).standard_normal(g.shape)
    eps = 1e-5
    lp = np.sum(np_moe(x, {**p64, key: p64[key] + eps * v}, cfg)[0] * r64)
    lm = np.sum(np_moe(x, {**p64, key: p64[key] - eps * v}, cfg)[0] * r64)
    np.testing.assert_allclose(np.sum(g * v), (lp - lm) / (2 * eps), rtol=f32_rtol(1e-4))


# ---------------------------------------------------------------- balancing


def test_update_routing_bias_direction_and_magnitude():
  bias = jnp.array([0.1, -0.2, 0.0, 0.3])
  load = jnp.array([0.4, 0.1, 0.25, 0.25])  # mean 0.25: expert 0 over, 1 under, 2 and 3 at the mean
  np.testing.assert_allclose(moe.update_routing_bias(bias, load, 0.01), [0.09, -0.19, 0.0, 0.3], rtol=1e-6)
  stacked = moe.update_routing_bias(jnp.stack([bias, bias]), jnp.stack([load, load[::-1]]), 0.5)  # [L,E]
  np.testing.assert_allclose(stacked, [[-0.4, 0.3, 0.0, 0.3], [0.1, -0.2, 0.5, -0.2]], rtol=1e-6)


def test_train_updates_each_layers_bias_by_its_own_load_scanned_or_not():
  from MaxText.train import update_routing_biases
  load = jnp.array([[0.4, 0.1, 0.25, 0.25], [0.1, 0.4, 0.25, 0.25]])  # [L_moe=2,E=4]
  keys = dict(num_experts=4, n_routing_groups=2, topk_routing_group=2, num_decoder_layers=3, mtp_num_layers=0)
  want = moe.update_routing_bias(jnp.zeros((2, 4)), load, make_config(**keys).routed_bias_update_rate)  # [2,4]
  stacked = {"moe_layers": {"layers": {"mlp": {"routing_bias": jnp.zeros((2, 4))}}}}
  got = update_routing_biases(make_config(**keys), stacked, {"expert_load": load})
  np.testing.assert_array_equal(got["moe_layers"]["layers"]["mlp"]["routing_bias"], want)
  per_layer = {"moe_layers": {"layers": {i: {"mlp": {"routing_bias": jnp.zeros(4)}} for i in range(2)}}}
  got = update_routing_biases(make_config(scan_layers=False, **keys), per_layer, {"expert_load": load})
  for i in range(2):  # each layer's own row, not every layer's [2,4]
    np.testing.assert_array_equal(got["moe_layers"]["layers"][i]["mlp"]["routing_bias"], want[i])


def test_bias_updates_even_out_a_skewed_load():
  cfg, model = make_model(**ROUTE_CFG)
  routing = moe.Routing.of(cfg)
  x = rand_x(cfg, b=4, t=16).reshape(-1, cfg.emb_dim)
  logits = x @ model.gate_kernel[...] + jnp.zeros(16).at[:4].set(1.5)  # group 0 favoured

  @jax.jit
  def run(bias):
    def step(b, _):
      _, ids, _ = moe.route(logits, b, routing)
      load = moe.expert_load(ids, 16)
      return moe.update_routing_bias(b, load, 0.01), load.max()
    return jax.lax.scan(step, bias, None, length=300)

  bias, max_load = run(jnp.zeros(16, jnp.float32))
  assert max_load[0] > 0.12 and float(max_load[-50:].mean()) < 0.8 * float(max_load[0])
  assert float(bias[0]) < 0  # the favoured expert was pushed down


def test_routing_bias_is_not_a_param():
  _, model = make_model()
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert not any("routing_bias" in path for path, _ in params)
  biases = nnx.to_flat_state(nnx.state(model, moe.RoutingBias))
  assert [path for path, _ in biases] == [("routing_bias",)]
  assert not issubclass(moe.RoutingBias, nnx.Param)
  _, no_bias = make_model(routed_bias=False)
  assert not nnx.to_flat_state(nnx.state(no_bias, moe.RoutingBias))


def np_balance_loss(scores, ids, weight):
  b, t, e = scores.shape
  k = ids.shape[-1]
  total = 0.0
  for s_, i_ in zip(scores, ids):
    f = np.bincount(i_.reshape(-1), minlength=e) * e / (k * t)
    p = (s_ / s_.sum(-1, keepdims=True)).mean(0)
    total += weight * np.sum(f * p)
  return total / b


def test_expert_load_and_load_balance_loss():
  cfg0, m0 = make_model(**ROUTE_CFG)
  x = rand_x(cfg0)
  _, aux0 = apply(m0, x)
  assert aux0["expert_load"].shape == (16,) and aux0["expert_load"].dtype == jnp.float32
  np.testing.assert_allclose(float(aux0["expert_load"].sum()), 1.0, rtol=1e-6)
  assert isinstance(aux0["load_balance_loss"], jax.Array) and float(aux0["load_balance_loss"]) == 0.0

  cfg, model = make_model(**ROUTE_CFG, load_balance_loss_weight=0.01)
  _, aux = apply(model, x)
  xf = np.asarray(x, np.float64).reshape(-1, cfg.emb_dim)
  _, ids, s = np_route(xf @ params64(model)["gate"], np.zeros(16), cfg)
  np.testing.assert_allclose(aux["expert_load"], np.bincount(ids.reshape(-1), minlength=16) / ids.size)
  ref = np_balance_loss(s.reshape(2, 8, 16), ids.reshape(2, 8, 4), 0.01)
  assert float(aux["load_balance_loss"]) > 0
  np.testing.assert_allclose(float(aux["load_balance_loss"]), ref, rtol=1e-5)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  g = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p, rest)(x)[1]["load_balance_loss"]))(params)
  assert float(jnp.abs(g["gate_kernel"][...]).max()) > 0  # the loss trains the router


@pytest.mark.parametrize("mesh", [{}, dict(ici_data_parallelism=2, ici_expert_parallelism=2, ici_context_parallelism=2)],
                         ids=["one_device", "data2xexpert2xcontext2"])
def test_padding_is_neither_routed_nor_counted(mesh):
  # segment_id 0 marks padding: its tokens take no expert, count in no load and in no balance term;
  # a row of padding only is no sequence: the balance loss averages over the rows with real tokens.
  # With a mesh: the expert-parallel path (rows over data x expert, each row's tokens over context).
  if mesh and jax.device_count() < 8:
    pytest.skip("needs 8 devices (8 simulated CPU devices in tests/conftest.py)")
  # XLA:CPU lacks ragged_all_to_all, the GPU row's exchange (MAXTEXT_TEST_KERNEL_ROW=gpu): the CPU's one here
  exchange = dict(moe_exchange="all_to_all") if mesh and jax.default_backend() == "cpu" else {}
  cfg, model = make_model(**ROUTE_CFG, load_balance_loss_weight=0.01, num_devices=int(np.prod([*mesh.values()])),
                          **mesh, **exchange)
  x = rand_x(cfg, b=4)  # [4,8,D]
  seg = np.ones((4, 8), np.int32)
  seg[0, 5:] = 0
  seg[1, 2:] = 0
  seg[2] = 0
  with sharding.logical_rules(cfg, sharding.create_mesh(cfg)) if mesh else contextlib.nullcontext():
    y, aux = nnx.jit(lambda m, x, s: m(x, s))(model, x, jnp.asarray(seg))
  xf = np.asarray(x, np.float64).reshape(-1, cfg.emb_dim)
  _, ids, s = np_route(xf @ params64(model)["gate"], np.zeros(16), cfg)
  real = seg.reshape(-1) != 0
  np.testing.assert_allclose(aux["expert_load"], np.bincount(ids[real].reshape(-1), minlength=16) / ids[real].size,
                             rtol=1e-6)
  rows = [(0, 5), (8, 10), (24, 32)]  # the real tokens of rows 0, 1 and 3 in [b*t]
  ref = sum(np_balance_loss(s[i:j][None], ids[i:j][None], 0.01) for i, j in rows) / len(rows)
  np.testing.assert_allclose(float(aux["load_balance_loss"]), ref, rtol=1e-5)
  # padding tokens get only the shared expert; real tokens equal the run without padding
  y_all, _ = apply(model, x)
  shared = nnx.jit(lambda m, x: m.shared_experts(x))(model, x)
  # atol: f32 rounding at the outputs' scale (|y| up to ~17; the mesh path's dots sum in another order)
  np.testing.assert_allclose(np.asarray(y)[seg != 0], np.asarray(y_all)[seg != 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y)[seg == 0], np.asarray(shared)[seg == 0], rtol=1e-5, atol=1e-6)
