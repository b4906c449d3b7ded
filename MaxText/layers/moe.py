"""DeepSeekMoE: sigmoid group-limited routing, dropless routed experts, shared experts.

DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2 and 2.2), in the order the data meets it; T tokens,
E routed experts in G groups, k experts per token, D = emb_dim, I = moe_mlp_dim:

    s      = sigmoid(x W_g)                        [T,E]  affinities, fp32 (softmax optional)
    s_b    = s + b                                 [T,E]  b: RoutingBias, for selection only
    g      = sum of the top-2 s_b of each group    [T,G]  keep the top `topk_routing_group` groups
    ids    = top-k of s_b over the kept groups     [T,k]
    w      = s[ids] / (sum s[ids] + 1e-20) * scale [T,k]  the UNBIASED scores of the chosen experts
    y      = sum_k w * SwiGLU_ids(x) + SwiGLU_shared(x)

The bias b is not trained by gradients: after each step the trainer moves it against the
measured expert load (`update_routing_bias`, the paper's auxiliary-loss-free balancing).

Dispatch is dropless and never computes all experts for all tokens: the T*k (token, expert)
assignments are sorted by expert, the tokens gathered into expert-contiguous rows, each expert's
rows multiplied by its weights (a grouped matmul), and the results gathered back to [T,k,D] and
summed with the routing weights. The grouped matmul has two implementations:

  "ragged_dot": `jax.lax.ragged_dot` on the sorted rows (group sizes from a bincount). TPU and GPU
      lower it to native grouped-GEMM kernels.
  "blocked": XLA:CPU (jax 0.10.2) lowers ragged_dot to a masked DENSE product over every expert
      (an [E,T*k,D] operand: E times the work; [32768,256]x[64,256,128] took 2.9 s against 0.02 s
      for one plain matmul of the same rows and 0.09-0.15 s blocked), so on CPU each expert's rows
      are padded to a multiple of B rows and each block multiplied by its expert's weights in one
      batched einsum. Still dropless, O(T*k + E*B) rows of compute.

`dispatch_impl()` picks by backend; see benchmarks/moe_dispatch.py for the measurements.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.linears import MLP, PRECISION, dtype_of, param
from MaxText.types import Config


class RoutingBias(nnx.Variable):
  """The selection-only correction bias b [E] (fp32). Not an nnx.Param, so the optimizer (which
  trains nnx.Param only) never touches it; the trainer sets it with `update_routing_bias`."""


# ---------------------------------------------------------------- routing


def route(logits: jax.Array, bias: jax.Array | None, *, num_experts_per_tok: int, n_routing_groups: int,
          topk_routing_group: int, routed_score_func: str, norm_topk_prob: bool,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group-limited top-k routing.

  logits [T,E] (the router matmul's output), bias [E] or None; the keywords are the config keys
  of the same names. Returns (weights [T,k] fp32, expert_ids [T,k] int32, scores [T,E] fp32).
  The bias only changes which experts are chosen; the weights come from the unbiased scores.
  A group is scored by the sum of its top-2 biased scores (as the official code and HF do).
  """
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
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T,k]
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)  # [T,k]
  return weights * routed_scaling_factor, expert_ids, scores


def routing_kwargs(config: Config) -> dict:
  """The static keyword arguments of `route`, read from the config."""
  keys = ("num_experts_per_tok", "n_routing_groups", "topk_routing_group", "routed_score_func",
          "norm_topk_prob", "routed_scaling_factor")
  return {k: getattr(config, k) for k in keys}


# ---------------------------------------------------------------- dropless dispatch


class DispatchPlan(NamedTuple):
  """Where each (token, slot) assignment lives in the expert-sorted row layout.

  Rows of one expert are contiguous, experts in order; with block_rows B > 1 each expert's rows
  are padded to a multiple of B (padding rows hold zeros). R = the static row count.
  """
  token_of_row: jax.Array  # [R] int32: the token whose hidden state fills the row (0 on padding)
  row_valid: jax.Array  # [R] bool: False on padding rows
  row_of_assignment: jax.Array  # [T*k] int32: the row that holds assignment (t, j) at t*k + j
  group_sizes: jax.Array  # [E] int32: assignments per expert (unpadded)
  block_expert: jax.Array  # [R/B] int32: the expert of each block of B rows


def plan_dispatch(expert_ids: jax.Array, num_experts: int, block_rows: int = 1) -> DispatchPlan:
  """expert_ids [T,k] -> the sorted (B = 1, for ragged_dot) or block-padded (B > 1) layout."""
  num_tokens, k = expert_ids.shape
  m, b = num_tokens * k, block_rows
  ids = expert_ids.reshape(m)  # [M], assignment a = t*k + j
  order = jnp.argsort(ids, stable=True)  # [M] assignments sorted by expert
  ids_sorted = ids[order]  # [M]
  sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)  # [E]
  starts = jnp.cumsum(sizes) - sizes  # [E] first sorted row of each expert
  padded = (sizes + b - 1) // b * b  # [E]
  padded_ends = jnp.cumsum(padded)  # [E]
  padded_starts = padded_ends - padded  # [E]
  row_of_sorted = padded_starts[ids_sorted] + jnp.arange(m) - starts[ids_sorted]  # [M]

  num_blocks = -(-(m + num_experts * (b - 1)) // b)  # sum_e ceil(size_e / B) never exceeds this
  num_rows = num_blocks * b
  row_of_assignment = jnp.zeros((m,), jnp.int32).at[order].set(row_of_sorted)  # [M]
  token_of_row = jnp.zeros((num_rows,), jnp.int32).at[row_of_sorted].set(order // k)  # [R]
  row_valid = jnp.zeros((num_rows,), bool).at[row_of_sorted].set(True)  # [R]
  block_expert = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * b, side="right")  # [R/B]
  block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)  # trailing blocks: all padding
  return DispatchPlan(token_of_row, row_valid, row_of_assignment, sizes, block_expert)


def grouped_matmul(rows: jax.Array, w: jax.Array, plan: DispatchPlan, *, impl: str,
                   precision=None) -> jax.Array:
  """rows [R,K] (expert-contiguous, per `plan`) x w [E,K,N] -> [R,N], each row by its expert."""
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(rows, w, plan.group_sizes, precision=precision)  # [R,N]
  if impl != "blocked":
    raise ValueError(f"grouped_matmul impl={impl!r}: expected 'ragged_dot' or 'blocked'")
  num_blocks = plan.block_expert.shape[0]
  rows_blocks = rows.reshape(num_blocks, -1, rows.shape[-1])  # [R/B,B,K]
  w_blocks = w[plan.block_expert]  # [R/B,K,N]
  out = jnp.einsum("nbk,nkj->nbj", rows_blocks, w_blocks, precision=precision)  # [R/B,B,N]
  return out.reshape(rows.shape[0], w.shape[-1])  # [R,N]


def dispatch_impl() -> str:
  """'blocked' on CPU (where ragged_dot is a dense product over all experts), else 'ragged_dot'."""
  return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


def default_block_rows(num_assignments: int, num_experts: int) -> int:
  """Blocked path's B: a power of 2 near half the mean rows per expert, in [8, 256]; padding then
  adds at most E*(B-1) rows, about half the T*k real ones at the mean."""
  target = max(1, num_assignments // (2 * num_experts))
  return int(min(256, max(8, 1 << (target.bit_length() - 1))))


def routed_experts(x: jax.Array, weights: jax.Array, expert_ids: jax.Array, wi_0: jax.Array,
                   wi_1: jax.Array, wo: jax.Array, *, impl: str, block_rows: int | None = None,
                   precision=None) -> jax.Array:
  """sum_j weights[t,j] * SwiGLU_{expert_ids[t,j]}(x[t]), dropless.

  x [T,D], weights [T,k], expert_ids [T,k], wi_0/wi_1 [E,D,I], wo [E,I,D] -> [T,D] in x.dtype.
  """
  num_tokens, d = x.shape
  k, num_experts = expert_ids.shape[1], wi_0.shape[0]
  if impl == "ragged_dot":
    block_rows = 1
  elif block_rows is None:
    block_rows = default_block_rows(num_tokens * k, num_experts)
  plan = plan_dispatch(expert_ids, num_experts, block_rows)

  rows = x[plan.token_of_row]  # [R,D]
  if block_rows > 1:
    rows = jnp.where(plan.row_valid[:, None], rows, jnp.zeros_like(rows))  # [R,D] zero padding
  mm = lambda a, w: grouped_matmul(a, w.astype(x.dtype), plan, impl=impl, precision=precision)
  hidden = jax.nn.silu(mm(rows, wi_0)) * mm(rows, wi_1)  # [R,I]; padding rows stay 0
  hidden = checkpoint_name(hidden, "moe_expert_hidden")
  out_rows = checkpoint_name(mm(hidden, wo), "moe_expert_out")  # [R,D]

  out = out_rows[plan.row_of_assignment].reshape(num_tokens, k, d)  # [T,k,D]
  y = jnp.einsum("tkd,tk->td", out, weights.astype(x.dtype), precision=precision,
                 preferred_element_type=jnp.float32)  # [T,D]
  return y.astype(x.dtype)


# ---------------------------------------------------------------- balancing


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """expert_ids [...,k] -> [E] fp32: the fraction of all assignments each expert received (sums to 1)."""
  counts = jnp.bincount(expert_ids.reshape(-1), length=num_experts)  # [E]
  return counts.astype(jnp.float32) / expert_ids.size


def sequence_balance_loss(scores: jax.Array, expert_ids: jax.Array, weight: float) -> jax.Array:
  """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20), averaged over sequences.

  scores [b,t,E] (unbiased affinities), expert_ids [b,t,k]. Per sequence:
    f_i = E / (k t) * #{tokens choosing i},  P_i = mean_t s_{i,t} / sum_j s_{j,t},  L = weight * sum_i f_i P_i.
  f carries no gradient; P does (through the scores). 1.0 * weight at a perfectly even load.
  """
  _, t, num_experts = scores.shape
  k = expert_ids.shape[-1]
  counts = jax.vmap(lambda ids: jnp.bincount(ids.reshape(-1), length=num_experts))(expert_ids)  # [b,E]
  f = counts.astype(jnp.float32) * (num_experts / (k * t))  # [b,E]
  p = jnp.mean(scores / scores.sum(-1, keepdims=True), axis=1)  # [b,E]
  return weight * jnp.mean(jnp.sum(f * p, axis=-1))


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
  """Routed experts (group-limited sigmoid routing, dropless dispatch) + shared experts."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    e, d, i = config.num_experts, config.emb_dim, config.moe_mlp_dim
    self.config = config
    self.dtype = dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]
    self.dispatch = dispatch_impl()  # a plain attribute: tests and benchmarks may set it
    self.gate_kernel = param(rngs, (d, e), ("embed", "exp"), config)  # router W_g
    self.routing_bias = RoutingBias(jnp.zeros((e,), jnp.float32), logical_axes=("exp",)) \
        if config.routed_bias else None
    self.wi_0 = param(rngs, (e, d, i), ("exp", "embed", "mlp"), config)  # gate
    self.wi_1 = param(rngs, (e, d, i), ("exp", "embed", "mlp"), config)  # up
    self.wo = param(rngs, (e, i, d), ("exp", "mlp", "embed"), config)  # down
    self.shared_experts = MLP(config, config.moe_mlp_dim * config.shared_experts, rngs=rngs) \
        if config.shared_experts else None

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
    """x [b,t,D] -> (y [b,t,D], {"expert_load": [E] fp32, "load_balance_loss": [] fp32})."""
    cfg = self.config
    b, t, d = x.shape
    x_flat = x.reshape(b * t, d)  # [T,D]

    # The router runs in full fp32 (HIGHEST: no bf16 passes on TPU): routing flips on small logit errors.
    logits = jnp.einsum("td,de->te", x_flat.astype(jnp.float32), self.gate_kernel[...].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)  # [T,E]
    logits = checkpoint_name(logits, "moe_gate_out")
    bias = None if self.routing_bias is None else jax.lax.stop_gradient(self.routing_bias[...])
    weights, expert_ids, scores = route(logits, bias, **routing_kwargs(cfg))  # [T,k], [T,k], [T,E]

    x_flat = x_flat.astype(self.dtype)  # [T,D]
    y = routed_experts(x_flat, weights, expert_ids, self.wi_0[...], self.wi_1[...], self.wo[...],
                       impl=self.dispatch, precision=self.precision)  # [T,D]
    if self.shared_experts is not None:
      y = y + self.shared_experts(x_flat)  # [T,D]
    y = checkpoint_name(y.reshape(b, t, d), "moe_out")  # [b,t,D]

    k = cfg.num_experts_per_tok
    if cfg.load_balance_loss_weight > 0:
      balance = sequence_balance_loss(scores.reshape(b, t, -1), expert_ids.reshape(b, t, k),
                                      cfg.load_balance_loss_weight)
    else:
      balance = jnp.zeros((), jnp.float32)
    aux = {"expert_load": expert_load(expert_ids, cfg.num_experts), "load_balance_loss": balance}
    return y, aux
