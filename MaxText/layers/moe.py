"""DeepSeekMoE: sigmoid group-limited routing, dropless routed experts, shared experts.

DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2 and 2.2), in the order the data meets it; T tokens,
E routed experts in G groups, k experts per token, D = emb_dim, I = moe_mlp_dim:

    s      = sigmoid(x W_g)                        [T,E]  affinities, fp32 (softmax optional)
    s_b    = s + b                                 [T,E]  b: RoutingBias, for selection only
    g      = sum of the top-2 s_b of each group    [T,G]  keep the top `topk_routing_group` groups
    ids    = top-k of s_b over the kept groups     [T,k]
    w      = s[ids] / (sum s[ids] + 1e-20) * scale [T,k]  the UNBIASED scores of the chosen experts
    y      = sum_k w * SwiGLU_ids(x) + SwiGLU_shared(x)

Forced routing (RL's keep routing, DeepSeek-V3.2 sec. 3.1): given recorded expert ids [T,k] the layer
takes those experts instead of its own top-k, with w from the CURRENT router's scores of them
(normalized and scaled as above, so gradients reach the router through w); a token whose recorded
ids are negative (-1: not recorded) routes as usual. The ids each layer chose (or was given) come
back in aux["routed_experts"] [b,t,k] (jit drops it where no caller keeps it).

The bias b is not trained by gradients: after each step the trainer moves it against the
measured expert load (`update_routing_bias`, the paper's auxiliary-loss-free balancing).

The routed experts are computed dropless (kernels/moe_experts.py: a grouped matmul over
expert-sorted rows); on a mesh they run under shard_map with expert parallelism
(kernels/moe_dispatch.py, every MoE collective).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.config.types import Config
from MaxText.kernels.moe_dispatch import exchange_impl, moe_on_mesh
from MaxText.kernels.moe_experts import (
  ExpertLoRA,
  ExpertWeights,
  balance_loss_terms,
  balance_stats,
  dispatch_impl,
  expert_counts,
  load_of,
  weighted_experts,
)
from MaxText.layers.linears import MLP, PRECISION, dtype_of, param, stored, weight_params
from MaxText.runtime.sharding import active_mesh

EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")  # the routed experts' [E,D,I] gate, [E,D,I] up, [E,I,D] down
ADAPTER_SUFFIX = "_lora"  # the per-expert adapter of routed-expert weight `w` is the module `<w>_lora` beside it


class ExpertAdapter(nnx.Module):
  """Per-expert LoRA of one routed-expert weight W [E, in, out] (layers/lora.py adds it where lora_module_path
  matches `.../mlp/wi_0`, `wi_1` or `wo`): lora_a [E, in, r], lora_b [E, r, out] (zeros at init), and
  W_e x + (lora_alpha / r) B_e A_e x for each expert e, inside the grouped matmul (kernels/moe_experts.py)."""

  def __init__(self, lora_a: nnx.Param, lora_b: nnx.Param, scale: float):
    self.lora_a, self.lora_b, self.lora_scale = lora_a, lora_b, scale

  def on(self, w) -> ExpertLoRA:
    """The stored base weight w [E,in,out] (float or BlockFP8) with this adapter: B pre-scaled by alpha / r."""
    return ExpertLoRA(w, self.lora_a[...], self.lora_b[...] * self.lora_scale)


class RoutingBias(nnx.Variable):
  """The selection-only correction bias b [E] (fp32). Not an nnx.Param, so the optimizer (which
  trains nnx.Param only) never touches it; the trainer sets it with `update_routing_bias`."""


# ---------------------------------------------------------------- routing


class Routing(NamedTuple):
  """The static routing keys (the config keys of the same names); hashable, so a jit static argument."""
  num_experts_per_tok: int
  n_routing_groups: int
  topk_routing_group: int
  routed_score_func: str  # "sigmoid" | "softmax"
  norm_topk_prob: bool
  routed_scaling_factor: float

  @classmethod
  def of(cls, config: Config) -> "Routing":
    return cls(num_experts_per_tok=config.num_experts_per_tok, n_routing_groups=config.n_routing_groups,
               topk_routing_group=config.topk_routing_group, routed_score_func=config.routed_score_func,
               norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor)


def route(logits: jax.Array, bias: jax.Array | None, routing: Routing,
          routed_experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group-limited top-k routing.

  logits [T,E] (the router matmul's output), bias [E] or None. Returns (weights [T,k] fp32,
  expert_ids [T,k] int32, scores [T,E] fp32).
  The bias only changes which experts are chosen; the weights come from the unbiased scores.
  A group is scored by the sum of its top-2 biased scores (as the official code and HF do).
  routed_experts [T,k] int32 (keep routing): each token with routed_experts[t,0] >= 0 takes those experts (weights
  from this router's scores of them, normalized and scaled alike); the others route as above.
  """
  num_experts_per_tok, n_routing_groups, topk_routing_group, routed_score_func, norm_topk_prob, \
      routed_scaling_factor = routing
  num_tokens, num_experts = logits.shape
  logits = logits.astype(jnp.float32)
  if routed_score_func == "sigmoid":
    scores = jax.nn.sigmoid(logits)  # [T,E]
  else:
    scores = jax.nn.softmax(logits, axis=-1)  # [T,E]
  choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]  # [T,E]

  if n_routing_groups > 1:
    per_group = num_experts // n_routing_groups
    grouped = choice.reshape(num_tokens, n_routing_groups, per_group)  # [T,G,E/G]
    group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [T,G]
    kept = jax.lax.top_k(group_scores, topk_routing_group)[1]  # [T,topk_groups]
    group_mask = jnp.any(kept[:, :, None] == jnp.arange(n_routing_groups), axis=1)  # [T,G]
    grouped = jnp.where(group_mask[:, :, None], grouped, -jnp.inf)  # [T,G,E/G]
    choice = grouped.reshape(num_tokens, num_experts)  # [T,E]

  expert_ids = jax.lax.top_k(choice, num_experts_per_tok)[1].astype(jnp.int32)  # [T,k]
  if routed_experts is not None:
    expert_ids = jnp.where(routed_experts[:, :1] >= 0, routed_experts.astype(jnp.int32), expert_ids)  # [T,k]
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T,k]
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)  # [T,k]
  return weights * routed_scaling_factor, expert_ids, scores


# ---------------------------------------------------------------- balancing


def expert_load(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """expert_ids [...,k] -> [E] fp32: the fraction of all (valid) assignments each expert received
  (sums to 1; all zeros when nothing is valid)."""
  return load_of(expert_counts(expert_ids, num_experts, valid))


def sequence_balance_loss(scores: jax.Array, expert_ids: jax.Array, weight: float,
                          token_valid: jax.Array | None = None) -> jax.Array:
  """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20), averaged over sequences.

  scores [b,t,E] (unbiased affinities), expert_ids [b,t,k], token_valid [b,t] (None: all real).
  Per sequence, over its n real tokens:
    f_i = E / (k n) * #{tokens choosing i},  P_i = mean_t s_{i,t} / sum_j s_{j,t},  L = weight * sum_i f_i P_i.
  f carries no gradient; P does (through the scores). 1.0 * weight at a perfectly even load.
  Sequences without real tokens are left out of the mean.
  """
  if token_valid is None:
    token_valid = jnp.ones(scores.shape[:2], bool)
  total, seqs = balance_loss_terms(*balance_stats(scores, expert_ids, token_valid), expert_ids.shape[-1])
  return weight * total / jnp.maximum(seqs, 1.0)


def update_routing_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): b_i += rate * sign(mean(load) - load_i).

  Experts above the mean load get their bias lowered (chosen less often), those below raised;
  an expert exactly at the mean keeps its bias. bias and load [..., E] (leading axes, e.g.
  stacked layers [L,E], broadcast); returns the new bias in bias.dtype.
  """
  load = load.astype(jnp.float32)
  step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)  # [...,E]
  return (bias.astype(jnp.float32) + step).astype(bias.dtype)


# ---------------------------------------------------------------- the layer


class DeepSeekMoE(nnx.Module):
  """Routed experts (group-limited sigmoid routing, dropless dispatch) + shared experts.

  On a mesh (under sharding.logical_rules with more than one device) the routed experts run under
  shard_map with expert parallelism (kernels/moe_dispatch.py); alone, on one device.
  Under weight_quantization=fp8_block the routed experts' wi_0, wi_1, wo are float8_e4m3fn with
  `<name>_scale` [E, ceil(in/b_in), ceil(out/b_out)] fp32 beside them, dequantized per expert inside
  the grouped matmul (kernels/moe_experts.py); the router stays float, as in DeepSeek's checkpoints.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    e, d, i = config.num_experts, config.emb_dim, config.moe_mlp_dim
    self.config = config
    self.dtype = dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]
    self.dispatch = dispatch_impl()  # a plain attribute: tests and benchmarks may set it
    self.exchange = exchange_impl(config.moe_exchange)  # likewise
    self.routing = Routing.of(config)
    self.gate_kernel = param(rngs, (d, e), ("embed", "exp"), config)  # router W_g
    self.routing_bias = RoutingBias(jnp.zeros((e,), jnp.float32), logical_axes=("exp",)) \
        if config.routed_bias else None
    self.wi_0, self.wi_0_scale = weight_params(rngs, (e, d, i), ("exp", "embed", "mlp"), config,
                                               block_quantized=True)  # gate
    self.wi_1, self.wi_1_scale = weight_params(rngs, (e, d, i), ("exp", "embed", "mlp"), config,
                                               block_quantized=True)  # up
    self.wo, self.wo_scale = weight_params(rngs, (e, i, d), ("exp", "mlp", "embed"), config,
                                           block_quantized=True)  # down
    self.shared_experts = MLP(config, config.moe_mlp_dim * config.shared_experts, rngs=rngs) \
        if config.shared_experts else None
    # per-expert adapters, set by lora.add_adapters where lora_module_path matches the weight's path
    self.wi_0_lora: ExpertAdapter | None = nnx.data(None)
    self.wi_1_lora: ExpertAdapter | None = nnx.data(None)
    self.wo_lora: ExpertAdapter | None = nnx.data(None)

  def expert_weight(self, name: str):
    """Routed-expert weight `name` as the grouped matmul takes it: float, BlockFP8, or ExpertLoRA over either."""
    w = stored(getattr(self, name), getattr(self, name + "_scale"))
    adapter = getattr(self, name + ADAPTER_SUFFIX)
    return w if adapter is None else adapter.on(w)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               routed_experts: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """x [b,t,D], segment_ids [b,t] (0 = padding: not routed, not counted; None = all real),
    routed_experts [b,t,k] int32 (keep routing, see `route`; None = route freely) -> (y [b,t,D],
    {"expert_load": [E] fp32, "load_balance_loss": [] fp32, "moe_dropped": [] fp32,
     "routed_experts": [b,t,k] int32 the experts each token took})."""
    cfg = self.config
    b, t, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    token_valid = jnp.ones((b, t), bool) if segment_ids is None else segment_ids != 0  # [b,t]
    gate = self.gate_kernel[...].astype(jnp.float32)  # [D,E]
    bias = jnp.zeros((e,), jnp.float32) if self.routing_bias is None \
        else jax.lax.stop_gradient(self.routing_bias[...])  # [E] selection only
    xc = x.astype(self.dtype)  # [b,t,D]
    weight = cfg.load_balance_loss_weight
    mesh = active_mesh()
    experts = ExpertWeights(*(self.expert_weight(n) for n in EXPERT_WEIGHTS))  # [E,D,I] x2, [E,I,D] (+ adapters)
    if mesh is not None and mesh[0].size > 1:  # expert parallelism: routing and experts per device
      r = moe_on_mesh(xc, token_valid, gate, bias, experts, route_fn=self.route, mesh=mesh[0], rules=mesh[1],
                      capacity_factor=cfg.moe_capacity_factor, exchange=self.exchange, impl=self.dispatch,
                      balance=weight > 0, precision=self.precision, routed_experts=routed_experts)
      y, counts, dropped, expert_ids = r.y, r.counts, r.dropped, r.ids  # [b,t,D], [E], [], [b,t,k]
      balance = weight * r.balance_sum / jnp.maximum(r.balance_seqs, 1.0)
    else:
      routed = None if routed_experts is None else routed_experts.reshape(b * t, k)  # [T,k]
      weights, expert_ids, scores = self.route(xc.reshape(b * t, d).astype(jnp.float32), gate, bias,
                                               routed)  # [T,k] [T,k] [T,E]
      slot_valid = jnp.broadcast_to(token_valid.reshape(b * t, 1), expert_ids.shape)  # [T,k]
      y = weighted_experts(xc.reshape(b * t, d), weights, expert_ids, experts, impl=self.dispatch,
                           precision=self.precision, valid=slot_valid).reshape(b, t, d)  # [b,t,D]
      counts, dropped = expert_counts(expert_ids, e, slot_valid), jnp.int32(0)
      balance = sequence_balance_loss(scores.reshape(b, t, e), expert_ids.reshape(b, t, k), weight, token_valid) \
          if weight > 0 else jnp.zeros((), jnp.float32)
      expert_ids = expert_ids.reshape(b, t, k)  # [b,t,k]
    if self.shared_experts is not None:
      y = y + self.shared_experts(xc)  # [b,t,D]
    y = checkpoint_name(y, "moe_out")  # [b,t,D]
    total = jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
    aux = {"expert_load": load_of(counts), "load_balance_loss": balance,
           "moe_dropped": dropped.astype(jnp.float32) / total, "routed_experts": expert_ids}
    return y, aux

  def route(self, x: jax.Array, gate: jax.Array, bias: jax.Array,
            routed_experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T,D] fp32, gate [D,E], bias [E], routed_experts [T,k] or None (`route`) -> (weights [T,k],
    expert_ids [T,k], scores [T,E]).
    The router runs in full fp32 (HIGHEST: no bf16 passes on TPU): routing flips on small logit errors."""
    logits = jnp.einsum("td,de->te", x, gate, precision=jax.lax.Precision.HIGHEST)  # [T,E]
    logits = checkpoint_name(logits, "moe_gate_out")
    return route(logits, bias, self.routing, routed_experts)
