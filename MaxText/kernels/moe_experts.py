"""The routed experts on one device: dropless dispatch into expert-contiguous rows and a grouped matmul.

T tokens (S source rows), k slots each, E experts. The S*k (row, expert) assignments are sorted by
expert (`plan_dispatch`), the rows gathered into expert-contiguous order, each expert's rows
multiplied by its weights (`grouped_matmul`), and the results gathered back to [S,k,D]
(`expert_outputs`) and summed with the routing weights (`combine`). Dropless: every valid
assignment is computed; no expert computes every token.

The grouped matmul has two implementations, picked per backend by `dispatch_impl` (backend.py's
grouped_matmul):
  "ragged_dot": `jax.lax.ragged_dot` on the sorted rows (group sizes from a bincount); TPU and GPU
      lower it to grouped-GEMM kernels. Called through ragged_matmul.py, whose batching rule folds a vmapped batch
      (the pipeline's stages) into the groups: XLA:TPU's grouped matmul takes no batch dimension.
  "blocked": each expert's rows padded to a multiple of B rows, each block multiplied by its
      expert's weights in one batched einsum: O(T*k + E*B) rows of compute. XLA:CPU lowers
      ragged_dot to a masked dense product over every expert (E times the work), so the CPU
      runs this; benchmarks/moe_dispatch.py (the matmul table) measures both.

Under weight_quantization=fp8_block the expert weights arrive as fp8_blocks.BlockFP8 and are
dequantized inside the grouped matmul, never all experts at once: the blocked path dequantizes the
gathered per-block copies (or one expert per loop step), ragged_dot runs over chunks of experts
(`ragged_dot_fp8`), each chunk dequantized right before its matmul.

With per-expert LoRA adapters (layers/lora.py, lora_module_path matching `.../mlp/wi_0`, `wi_1` or `wo`) a
weight arrives as ExpertLoRA (the frozen base + A [E,K,r] and B [E,r,N]): the grouped matmul runs the base and,
by the same plan, each row through its own expert's A then B (`grouped_matmul`), so the adapters are computed
dropless, per expert, and sharded over the expert axis as the experts are.

Also here: the expert counts and the per-sequence sums of the balance loss, which the
expert-parallel dispatch (moe_dispatch.py) adds up over devices.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.kernels import backend, ragged_matmul
from MaxText.kernels.fp8_blocks import BlockFP8, dequantize, dequantize_if, shape_of, take


class ExpertWeights(NamedTuple):
  """The routed experts' SwiGLU weights (on a mesh: this device's experts and hidden shard); each a
  float array or a BlockFP8 (fp8 values of that shape + per-block scales), or either as an ExpertLoRA's base."""
  wi_0: jax.Array | BlockFP8  # [E,D,I] gate
  wi_1: jax.Array | BlockFP8  # [E,D,I] up
  wo: jax.Array | BlockFP8  # [E,I,D] down


class ExpertLoRA(NamedTuple):
  """A routed-expert weight with its per-expert adapter: row x of expert e gives x W_e + (x A_e) B_e."""
  base: jax.Array | BlockFP8  # [E,K,N] the frozen weight
  a: jax.Array  # [E,K,r]
  b: jax.Array  # [E,r,N], already times lora_alpha / r


def base_of(w):
  """The frozen weight of an ExpertLoRA; any other weight as it is."""
  return w.base if isinstance(w, ExpertLoRA) else w


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
  starts = jnp.arange(num_blocks) * b  # [R/B] each block's first row
  # searchsorted(padded_ends, starts, side="right") written out: jnp.searchsorted's vmap fails inside a shard_map
  # under the pipeline's vmap over stages (jax 0.10: "requires varying manual axes to match")
  block_expert = jnp.sum(padded_ends[None, :] <= starts[:, None], axis=1)  # [R/B] groups ending at or before it
  block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)  # null/trailing blocks: zero rows
  return DispatchPlan(token_of_row, row_valid, row_of_assignment, sizes[:num_experts], block_expert)


# Blocked path: above this many elements of per-block weight copies ([R/B,K,N]) the blocks run in a
# loop instead of one batched einsum. One 671B expert-parallel layer (113 blocks of 2048 x 7168)
# would otherwise hold 6.2 GiB per copy, several live in the backward pass.
BLOCK_WEIGHT_COPY_LIMIT = 1 << 27


def ragged_dot_fp8(rows: jax.Array, w: BlockFP8, group_sizes: jax.Array, precision=None) -> jax.Array:
  """ragged_dot over fp8 experts, a chunk of experts at a time (at most BLOCK_WEIGHT_COPY_LIMIT
  dequantized elements live): rows [R,K] sorted by expert, w [E,K,N] -> [R,N] in rows.dtype.

  Chunk c's rows are contiguous (from `first`, the rows of earlier experts); they are rolled to the
  front, multiplied by the chunk's dequantized experts, rolled back and kept where they belong.
  Rows of no expert (the null group) are left 0."""
  num_experts, k, n = w.values.shape
  chunk = max([c for c in range(1, num_experts + 1) if num_experts % c == 0 and c * k * n <= BLOCK_WEIGHT_COPY_LIMIT]
              or [1])
  ends = jnp.cumsum(group_sizes)  # [E]
  starts = ends - group_sizes  # [E]
  row = jnp.arange(rows.shape[0])  # [R]

  def one(out, c):
    lo = c * chunk
    part = BlockFP8(*(jax.lax.dynamic_slice_in_dim(a, lo, chunk) for a in w))  # [C,K,N] fp8, [C,k/bk,n/bn]
    sizes = jax.lax.dynamic_slice_in_dim(group_sizes, lo, chunk)  # [C]
    first, last = starts[lo], ends[lo + chunk - 1]
    y = ragged_matmul.matmul(jnp.roll(rows, -first, axis=0), dequantize(part, rows.dtype), sizes,
                             precision=precision or backend.dot_precision(rows.dtype))  # [R,N]: the chunk's rows first
    mine = (row >= first) & (row < last)  # [R]
    return jnp.where(mine[:, None], jnp.roll(y, first, axis=0), out), None

  out, _ = jax.lax.scan(one, jnp.zeros((rows.shape[0], n), rows.dtype), jnp.arange(num_experts // chunk))
  return out  # [R,N]


def grouped_matmul(rows: jax.Array, w: jax.Array | BlockFP8, plan: DispatchPlan, *, impl: str,
                   precision=None) -> jax.Array:
  """rows [R,K] (expert-contiguous, per `plan`) x w [E,K,N] -> [R,N], each row by its expert.
  w float (cast to rows.dtype), BlockFP8 (dequantized to rows.dtype per expert / gathered block), or ExpertLoRA
  (the base's product + the adapter's: rows by A [E,K,r] -> [R,r], by B [E,r,N] -> [R,N], the same plan)."""
  if isinstance(w, ExpertLoRA):
    mm = lambda a, v: grouped_matmul(a, v, plan, impl=impl, precision=precision)  # noqa: E731
    return mm(rows, w.base) + mm(mm(rows, w.a), w.b)  # [R,N] + ([R,r] -> [R,N])
  _, k, n = shape_of(w)
  if impl == "ragged_dot":
    if isinstance(w, BlockFP8):
      return ragged_dot_fp8(rows, w, plan.group_sizes, precision)  # [R,N]
    return ragged_matmul.matmul(rows, w, plan.group_sizes,  # [R,N]; a Mosaic kernel on a TPU
                                precision=precision or backend.dot_precision(rows.dtype))
  if impl != "blocked":
    raise ValueError(f"grouped_matmul impl={impl!r}: expected 'ragged_dot' or 'blocked'")
  num_blocks = plan.block_expert.shape[0]
  rows_blocks = rows.reshape(num_blocks, -1, rows.shape[-1])  # [R/B,B,K]
  if num_blocks * k * n <= BLOCK_WEIGHT_COPY_LIMIT:
    w_blocks = dequantize_if(take(w, plan.block_expert), rows.dtype)  # [R/B,K,N]: its expert's weights per block
    out = jnp.einsum("nbk,nkj->nbj", rows_blocks, w_blocks, precision=precision)  # [R/B,B,N]
  else:  # a loop over blocks reads each block's expert weights in place: no [R/B,K,N] copy
    @jax.checkpoint  # the backward re-reads the block's weights: no stack of per-block slices saved
    def block(_, rb_e):
      rb, e = rb_e  # [B,K], []
      return None, jnp.dot(rb, dequantize_if(take(w, e), rows.dtype), precision=precision)  # [B,N]
    _, out = jax.lax.scan(block, None, (rows_blocks, plan.block_expert))  # [R/B,B,N]
  return out.reshape(rows.shape[0], n)  # [R,N]


def dispatch_impl() -> str:
  """backend.py's grouped_matmul: 'blocked' on CPU (where ragged_dot is a dense product over all
  experts), else 'ragged_dot'."""
  return backend.choice("grouped_matmul")


def default_block_rows(num_assignments: int, num_experts: int) -> int:
  """Blocked path's B: a power of 2 near half the mean rows per expert, in [8, 1024]; padding then
  adds at most E*(B-1) rows, about half the T*k real ones at the mean."""
  target = max(1, num_assignments // (2 * num_experts))
  return int(min(1024, max(8, 1 << (target.bit_length() - 1))))


def expert_outputs(x: jax.Array, expert_ids: jax.Array, experts: ExpertWeights, *, impl: str,
                   valid: jax.Array | None = None, block_rows: int | None = None, precision=None) -> jax.Array:
  """SwiGLU_{expert_ids[s,i]}(x[s]) for every assignment, dropless; zeros where not valid.

  x [S,D], expert_ids [S,j] (and valid [S,j]) in [0, E) -> [S,j,D] in x.dtype. With I sharded
  (tensor parallelism) the result is this shard's partial sum over I.
  """
  wi_0, wi_1, wo = experts
  num_src, d = x.shape
  j, num_experts = expert_ids.shape[1], shape_of(base_of(wi_0))[0]
  if impl == "ragged_dot":
    block_rows = 1
  elif block_rows is None:
    block_rows = default_block_rows(num_src * j, num_experts)
  plan = plan_dispatch(expert_ids, num_experts, block_rows, valid)

  rows = x[plan.token_of_row]  # [R,D]
  rows = jnp.where(plan.row_valid[:, None], rows, jnp.zeros_like(rows))  # [R,D] padding / null rows 0
  mm = lambda a, w: grouped_matmul(a, w, plan, impl=impl, precision=precision)
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


def weighted_experts(x: jax.Array, weights: jax.Array, expert_ids: jax.Array, experts: ExpertWeights, *,
                     impl: str, block_rows: int | None = None, precision=None,
                     valid: jax.Array | None = None) -> jax.Array:
  """sum_j weights[t,j] * SwiGLU_{expert_ids[t,j]}(x[t]) on one device, dropless.

  x [T,D], weights [T,k], expert_ids [T,k] (valid [T,k]: assignments to leave out, e.g. padding)
  -> [T,D] in x.dtype.
  """
  out = expert_outputs(x, expert_ids, experts, impl=impl, valid=valid, block_rows=block_rows,
                       precision=precision)  # [T,k,D]
  return combine(out, weights, precision).astype(x.dtype)


# ---------------------------------------------------------------- counts and balance sums


def expert_counts(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """expert_ids [...,k] (valid [...,k] or None) -> [E] int32: valid assignments per expert."""
  ids = expert_ids.reshape(-1)  # [N]
  if valid is not None:
    ids = jnp.where(valid.reshape(-1), ids, num_experts)  # [N] invalid -> a bin past the end
  return jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # [E]


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
