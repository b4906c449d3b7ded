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
from MaxText.sharding import active_mesh
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


def rank_within(keys: jax.Array, num_keys: int) -> jax.Array:
  """keys [M] in [0, num_keys) -> [M] int32: each element's rank among equal keys, in order."""
  m = keys.shape[0]
  order = jnp.argsort(keys, stable=True)  # [M]
  counts = jnp.bincount(keys, length=num_keys)  # [K]
  starts = jnp.cumsum(counts) - counts  # [K]
  ranked = jnp.arange(m, dtype=jnp.int32) - starts[keys[order]].astype(jnp.int32)  # [M] in sorted order
  return jnp.zeros((m,), jnp.int32).at[order].set(ranked)  # [M]


class DispatchPlan(NamedTuple):
  """Where each (row, slot) assignment lives in the expert-sorted row layout.

  Rows of one expert are contiguous, experts in order, then the rows of invalid assignments (a
  "null" group that no expert computes); with block_rows B > 1 each group's rows are padded to a
  multiple of B (padding rows hold zeros). R = the static row count.
  """
  token_of_row: jax.Array  # [R] int32: the source row whose hidden state fills the row (0 on padding)
  row_valid: jax.Array  # [R] bool: False on padding rows and on the null group's rows
  row_of_assignment: jax.Array  # [S*j] int32: the row that holds assignment (s, i) at s*j + i
  group_sizes: jax.Array  # [E] int32: valid assignments per expert (unpadded)
  block_expert: jax.Array  # [R/B] int32: the expert of each block of B rows


def plan_dispatch(expert_ids: jax.Array, num_experts: int, block_rows: int = 1,
                  valid: jax.Array | None = None) -> DispatchPlan:
  """expert_ids [S,j] (valid [S,j] or None: all valid) -> the sorted (B = 1, for ragged_dot) or
  block-padded (B > 1) layout. Invalid assignments sort last, into the null group E."""
  num_src, j = expert_ids.shape
  m, b, groups = num_src * j, block_rows, num_experts + 1
  ids = expert_ids.reshape(m)  # [M], assignment a = s*j + i
  if valid is not None:
    ids = jnp.where(valid.reshape(m), ids, num_experts)  # [M] invalid -> the null group
  sizes = jnp.bincount(ids, length=groups).astype(jnp.int32)  # [E+1]
  padded = (sizes + b - 1) // b * b  # [E+1]
  padded_ends = jnp.cumsum(padded)  # [E+1]
  padded_starts = padded_ends - padded  # [E+1]

  num_blocks = -(-(m + groups * (b - 1)) // b)  # sum_g ceil(size_g / B) never exceeds this
  num_rows = num_blocks * b
  row_of_assignment = padded_starts[ids] + rank_within(ids, groups)  # [M]
  token_of_row = jnp.zeros((num_rows,), jnp.int32).at[row_of_assignment].set(jnp.arange(m) // j)  # [R]
  row_valid = jnp.zeros((num_rows,), bool).at[row_of_assignment].set(ids < num_experts)  # [R]
  block_expert = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * b, side="right")  # [R/B]
  block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)  # null/trailing blocks: zero rows
  return DispatchPlan(token_of_row, row_valid, row_of_assignment, sizes[:num_experts], block_expert)


# Blocked path: above this many elements of per-block weight copies ([R/B,K,N]) the blocks run in a
# loop instead of one batched einsum. One 671B expert-parallel layer (113 blocks of 2048 x 7168)
# would otherwise hold 6.2 GiB per copy, several live in the backward pass.
BLOCK_WEIGHT_COPY_LIMIT = 1 << 27


def grouped_matmul(rows: jax.Array, w: jax.Array, plan: DispatchPlan, *, impl: str,
                   precision=None) -> jax.Array:
  """rows [R,K] (expert-contiguous, per `plan`) x w [E,K,N] -> [R,N], each row by its expert."""
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(rows, w, plan.group_sizes, precision=precision)  # [R,N]
  if impl != "blocked":
    raise ValueError(f"grouped_matmul impl={impl!r}: expected 'ragged_dot' or 'blocked'")
  num_blocks = plan.block_expert.shape[0]
  rows_blocks = rows.reshape(num_blocks, -1, rows.shape[-1])  # [R/B,B,K]
  if num_blocks * w.shape[1] * w.shape[2] <= BLOCK_WEIGHT_COPY_LIMIT:
    w_blocks = w[plan.block_expert]  # [R/B,K,N]: a copy of its expert's weights per block
    out = jnp.einsum("nbk,nkj->nbj", rows_blocks, w_blocks, precision=precision)  # [R/B,B,N]
  else:  # a loop over blocks reads each block's expert weights in place: no [R/B,K,N] copy
    @jax.checkpoint  # the backward re-reads the block's weights: no stack of per-block slices saved
    def block(_, rb_e):
      rb, e = rb_e  # [B,K], []
      return None, jnp.dot(rb, jax.lax.dynamic_index_in_dim(w, e, keepdims=False), precision=precision)  # [B,N]
    _, out = jax.lax.scan(block, None, (rows_blocks, plan.block_expert))  # [R/B,B,N]
  return out.reshape(rows.shape[0], w.shape[-1])  # [R,N]


def dispatch_impl() -> str:
  """'blocked' on CPU (where ragged_dot is a dense product over all experts), else 'ragged_dot'."""
  return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


def exchange_impl(key: str) -> str:
  """moe_exchange: 'auto' is ragged_all_to_all on GPU / TPU and the fixed-capacity all_to_all on
  CPU (XLA:CPU, jax 0.10.2, does not implement ragged-all-to-all)."""
  if key != "auto":
    return key
  return "all_to_all" if jax.default_backend() == "cpu" else "ragged_all_to_all"


def default_block_rows(num_assignments: int, num_experts: int) -> int:
  """Blocked path's B: a power of 2 near half the mean rows per expert, in [8, 1024]; padding then
  adds at most E*(B-1) rows, about half the T*k real ones at the mean."""
  target = max(1, num_assignments // (2 * num_experts))
  return int(min(1024, max(8, 1 << (target.bit_length() - 1))))


def expert_outputs(x: jax.Array, expert_ids: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array, *,
                   impl: str, valid: jax.Array | None = None, block_rows: int | None = None,
                   precision=None) -> jax.Array:
  """SwiGLU_{expert_ids[s,i]}(x[s]) for every assignment, dropless; zeros where not valid.

  x [S,D], expert_ids [S,j] (and valid [S,j]) in [0, E), wi_0/wi_1 [E,D,I], wo [E,I,D] -> [S,j,D]
  in x.dtype. With I sharded (tensor parallelism) the result is this shard's partial sum over I.
  """
  num_src, d = x.shape
  j, num_experts = expert_ids.shape[1], wi_0.shape[0]
  if impl == "ragged_dot":
    block_rows = 1
  elif block_rows is None:
    block_rows = default_block_rows(num_src * j, num_experts)
  plan = plan_dispatch(expert_ids, num_experts, block_rows, valid)

  rows = x[plan.token_of_row]  # [R,D]
  rows = jnp.where(plan.row_valid[:, None], rows, jnp.zeros_like(rows))  # [R,D] padding / null rows 0
  mm = lambda a, w: grouped_matmul(a, w.astype(x.dtype), plan, impl=impl, precision=precision)
  hidden = jax.nn.silu(mm(rows, wi_0)) * mm(rows, wi_1)  # [R,I]; padding rows stay 0
  hidden = checkpoint_name(hidden, "moe_expert_hidden")
  out_rows = checkpoint_name(mm(hidden, wo), "moe_expert_out")  # [R,D]
  out = out_rows[plan.row_of_assignment].reshape(num_src, j, d)  # [S,j,D]
  if valid is not None:  # the null group's rows lie outside ragged_dot's groups: their values are undefined
    out = jnp.where(valid[..., None], out, jnp.zeros_like(out))  # [S,j,D]
  return out


def combine(out: jax.Array, weights: jax.Array, precision=None) -> jax.Array:
  """out [T,k,D] (each assignment's expert output) x routing weights [T,k] -> [T,D] fp32."""
  return jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype), precision=precision,
                    preferred_element_type=jnp.float32)  # [T,D]


def routed_experts(x: jax.Array, weights: jax.Array, expert_ids: jax.Array, wi_0: jax.Array,
                   wi_1: jax.Array, wo: jax.Array, *, impl: str, block_rows: int | None = None,
                   precision=None, valid: jax.Array | None = None) -> jax.Array:
  """sum_j weights[t,j] * SwiGLU_{expert_ids[t,j]}(x[t]) on one device, dropless.

  x [T,D], weights [T,k], expert_ids [T,k] (valid [T,k]: assignments to leave out, e.g. padding),
  wi_0/wi_1 [E,D,I], wo [E,I,D] -> [T,D] in x.dtype.
  """
  out = expert_outputs(x, expert_ids, wi_0, wi_1, wo, impl=impl, valid=valid, block_rows=block_rows,
                       precision=precision)  # [T,k,D]
  return combine(out, weights, precision).astype(x.dtype)


# ---------------------------------------------------------------- balancing


def expert_counts(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """expert_ids [...,k] (valid [...,k] or None) -> [E] int32: valid assignments per expert."""
  ids = expert_ids.reshape(-1)  # [N]
  if valid is not None:
    ids = jnp.where(valid.reshape(-1), ids, num_experts)  # [N] invalid -> a bin past the end
  return jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # [E]


def expert_load(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """expert_ids [...,k] -> [E] fp32: the fraction of all (valid) assignments each expert received
  (sums to 1; all zeros when nothing is valid)."""
  return load_of(expert_counts(expert_ids, num_experts, valid))


def load_of(counts: jax.Array) -> jax.Array:
  """counts [E] -> [E] fp32: each expert's fraction of all assignments (all zeros for none)."""
  return counts.astype(jnp.float32) / jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)


def balance_stats(scores: jax.Array, expert_ids: jax.Array, token_valid: jax.Array) -> tuple:
  """Per-sequence sums of the sequence-wise balance loss, additive over sequence shards.

  scores [b,t,E] (unbiased affinities), expert_ids [b,t,k], token_valid [b,t] ->
  (counts [b,E] fp32: real tokens choosing each expert, share [b,E]: sum over real tokens of
  s_{i,t} / sum_j s_{j,t}, n [b] fp32: real tokens)."""
  num_experts = scores.shape[-1]
  slot_valid = jnp.broadcast_to(token_valid[..., None], expert_ids.shape)  # [b,t,k]
  counts = jax.vmap(lambda ids, v: expert_counts(ids, num_experts, v))(expert_ids, slot_valid)  # [b,E]
  share = scores / scores.sum(-1, keepdims=True)  # [b,t,E]
  share = jnp.sum(jnp.where(token_valid[..., None], share, 0.0), axis=1)  # [b,E]
  return counts.astype(jnp.float32), share, jnp.sum(token_valid, axis=1).astype(jnp.float32)


def balance_loss_terms(counts: jax.Array, share: jax.Array, n: jax.Array, k: int) -> tuple:
  """From `balance_stats` of whole sequences: (sum over sequences of sum_i f_i P_i, number of
  sequences with real tokens). f = E/(k n) * counts carries no gradient; P = share / n does."""
  num_experts = counts.shape[-1]
  n_safe = jnp.maximum(n, 1.0)[:, None]  # [b,1]
  f = jax.lax.stop_gradient(counts) * (num_experts / k) / n_safe  # [b,E]
  per_seq = jnp.sum(f * share / n_safe, axis=-1)  # [b]
  return jnp.sum(per_seq), jnp.sum(n > 0).astype(jnp.float32)


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
  shard_map with expert parallelism (moe_dispatch.py); alone, on one device.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    e, d, i = config.num_experts, config.emb_dim, config.moe_mlp_dim
    self.config = config
    self.dtype = dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]
    self.dispatch = dispatch_impl()  # a plain attribute: tests and benchmarks may set it
    self.exchange = exchange_impl(config.moe_exchange)  # likewise
    self.gate_kernel = param(rngs, (d, e), ("embed", "exp"), config)  # router W_g
    self.routing_bias = RoutingBias(jnp.zeros((e,), jnp.float32), logical_axes=("exp",)) \
        if config.routed_bias else None
    self.wi_0 = param(rngs, (e, d, i), ("exp", "embed", "mlp"), config)  # gate
    self.wi_1 = param(rngs, (e, d, i), ("exp", "embed", "mlp"), config)  # up
    self.wo = param(rngs, (e, i, d), ("exp", "mlp", "embed"), config)  # down
    self.shared_experts = MLP(config, config.moe_mlp_dim * config.shared_experts, rngs=rngs) \
        if config.shared_experts else None

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """x [b,t,D], segment_ids [b,t] (0 = padding: not routed, not counted; None = all real) ->
    (y [b,t,D], {"expert_load": [E] fp32, "load_balance_loss": [] fp32, "moe_dropped": [] fp32})."""
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
    if mesh is not None and mesh[0].size > 1:  # expert parallelism: routing and experts per device
      from MaxText.layers import moe_dispatch  # imports this module: a top-level import would be a cycle
      y, counts, dropped, (balance_sum, seqs) = moe_dispatch.moe_on_mesh(
          xc, token_valid, gate, bias, self.wi_0[...], self.wi_1[...], self.wo[...], route_fn=self.route,
          mesh=mesh[0], rules=mesh[1], capacity_factor=cfg.moe_capacity_factor, exchange=self.exchange,
          impl=self.dispatch, balance=weight > 0, precision=self.precision)  # [b,t,D], [E], [], ([], [])
      balance = weight * balance_sum / jnp.maximum(seqs, 1.0)
    else:
      weights, expert_ids, scores = self.route(xc.reshape(b * t, d).astype(jnp.float32), gate, bias)  # [T,k] [T,k] [T,E]
      slot_valid = jnp.broadcast_to(token_valid.reshape(b * t, 1), expert_ids.shape)  # [T,k]
      y = routed_experts(xc.reshape(b * t, d), weights, expert_ids, self.wi_0[...], self.wi_1[...], self.wo[...],
                         impl=self.dispatch, precision=self.precision, valid=slot_valid).reshape(b, t, d)  # [b,t,D]
      counts, dropped = expert_counts(expert_ids, e, slot_valid), jnp.int32(0)
      balance = sequence_balance_loss(scores.reshape(b, t, e), expert_ids.reshape(b, t, k), weight, token_valid) \
          if weight > 0 else jnp.zeros((), jnp.float32)
    if self.shared_experts is not None:
      y = y + self.shared_experts(xc)  # [b,t,D]
    y = checkpoint_name(y, "moe_out")  # [b,t,D]
    total = jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
    aux = {"expert_load": load_of(counts), "load_balance_loss": balance,
           "moe_dropped": dropped.astype(jnp.float32) / total}
    return y, aux

  def route(self, x: jax.Array, gate: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T,D] fp32, gate [D,E], bias [E] -> (weights [T,k], expert_ids [T,k], scores [T,E]).
    The router runs in full fp32 (HIGHEST: no bf16 passes on TPU): routing flips on small logit errors."""
    logits = jnp.einsum("td,de->te", x, gate, precision=jax.lax.Precision.HIGHEST)  # [T,E]
    logits = checkpoint_name(logits, "moe_gate_out")
    return route(logits, bias, **routing_kwargs(self.config))
