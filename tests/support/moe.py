"""DeepSeekMoE's float64 numpy references and tiny layers (tests/unit/test_moe.py, test_keep_routing.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers import moe
from tests.conftest import make_config

ROUTE_CFG = dict(num_experts=16, n_routing_groups=4, topk_routing_group=2, num_experts_per_tok=4)


def np_route(logits, bias, cfg):
  """Loops over tokens: group top-2 sums, kept groups, top-k in them, unbiased normalized weights."""
  logits = np.asarray(logits, np.float64)
  t_, e_ = logits.shape
  if cfg.routed_score_func == "sigmoid":
    s = 1.0 / (1.0 + np.exp(-logits))
  else:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    s = z / z.sum(-1, keepdims=True)
  c = s + (0.0 if bias is None else np.asarray(bias, np.float64))
  per = e_ // cfg.n_routing_groups
  weights, ids = [], []
  for t in range(t_):
    group_score = [np.sort(c[t, g * per:(g + 1) * per])[-2:].sum() for g in range(cfg.n_routing_groups)]
    kept = np.argsort(-np.array(group_score), kind="stable")[:cfg.topk_routing_group]
    allowed = [e for g in kept for e in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda e: -c[t, e])[:cfg.num_experts_per_tok]
    w = s[t, chosen]
    if cfg.norm_topk_prob:
      w = w / (w.sum() + 1e-20)
    weights.append(w * cfg.routed_scaling_factor)
    ids.append(chosen)
  return np.array(weights), np.array(ids), s


def np_swiglu(x, wg, wu, wd):
  g = x @ wg
  return ((g / (1.0 + np.exp(-g))) * (x @ wu)) @ wd


def params64(model):
  p = {"gate": model.gate_kernel[...], "wi_0": model.wi_0[...], "wi_1": model.wi_1[...], "wo": model.wo[...],
       "bias": None if model.routing_bias is None else model.routing_bias[...]}
  if model.shared_experts is not None:
    se = model.shared_experts
    p["shared"] = (se.gate.kernel[...], se.up.kernel[...], se.down.kernel[...])
  return {k: None if v is None else jax.tree.map(lambda a: np.asarray(a, np.float64), v) for k, v in p.items()}


def np_moe(x, p, cfg):
  """x [b,t,D] -> y [b,t,D]: for each token, its chosen experts one by one, plus the shared expert."""
  xf = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  weights, ids, _ = np_route(xf @ p["gate"], p["bias"], cfg)
  y = np.zeros_like(xf)
  for t in range(xf.shape[0]):
    for w, e in zip(weights[t], ids[t]):
      y[t] += w * np_swiglu(xf[t], p["wi_0"][e], p["wi_1"][e], p["wo"][e])
    if "shared" in p:
      y[t] += np_swiglu(xf[t], *p["shared"])
  return y.reshape(x.shape), ids


def make_model(seed=0, std=0.3, **overrides):
  """A DeepSeekMoE with O(1)-scale random weights, so routing scores are well separated."""
  cfg = make_config(**overrides)
  model = nnx.eval_shape(lambda: moe.DeepSeekMoE(cfg, rngs=nnx.Rngs(seed)))  # structure only: no init compiles
  rng = np.random.default_rng(seed)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      fan_in = var.shape[-2] if len(var.shape) >= 2 else 1
      var.set_value(jnp.asarray(rng.standard_normal(var.shape) * std * (64 / fan_in) ** 0.5, var.dtype))
    elif isinstance(var, nnx.Variable):
      var.set_value(jnp.zeros(var.shape, var.dtype))
  return cfg, model


def randn(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def rand_x(cfg, b=2, t=8, seed=1):
  return randn((b, t, cfg.emb_dim), seed)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)
