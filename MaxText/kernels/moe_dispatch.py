"""Expert parallelism: the routed experts under `jax.shard_map`, every collective written here.

GSPMD cannot partition the global sort of all (token, expert) assignments, so the routed experts
run per device with explicit collectives. On each device (T_l of its own tokens, k slots, M = T_l*k
assignments; ep devices on the `expert` axis, each owning E_l = E/ep consecutive experts):

  1. its tokens' assignments are ranked within their destination device (the expert's owner);
     the first C per destination are kept, the rest dropped (counted);        [M] -> kept [M]
  2. the kept rows travel to their owner:
       "all_to_all":        fixed [ep, C, D] slots per destination, `jax.lax.all_to_all`
                            (XLA:CPU; C from moe_capacity_factor, -1 = dropless: C = M);
       "ragged_all_to_all": compact rows sorted by destination, `jax.lax.ragged_all_to_all`
                            into an [ep*C, D] buffer (GPU / TPU: bytes on the wire = real rows);
  3. the owner runs its E_l experts on what it received (moe_experts.expert_outputs: a grouped matmul);
  4. the results go back by the reverse exchange and are combined with the routing weights on
     the token's device.

The expert axis must shard the tokens for (1)-(4). When it cannot (a batch smaller than the token
shards, e.g. decoding one sequence), each device instead runs its own E_l experts on all its
tokens and the partial outputs are summed over `expert` (a psum of [T_l, D]). Tensor parallelism
splits the experts' hidden dim I: every device computes a partial sum, added by a psum over
`tensor`. fsdp-sharded expert weights (plain arrays) enter the shard_map as they are stored, their model
dim D split over the ZeRO axes ("embed": fsdp, context), and are gathered inside by `all_gather`, one layer at a
time: its transpose is a reduce-scatter, so each device's expert gradient leaves [E_l, D/z, I_l] and is reduced
once. (Gathered by GSPMD before the shard_map, the gradient of the whole [E_l, D, I_l] was all-reduced over the
token axes and then sliced: on the 671B's 4K step, fsdp 32 x expert 8, 3 x 98 GiB a chip a step of all-reduce.)
The pipelined stack's too, under the stage vmap (XLA:TPU's 11-layer 2-stage 671B step: 30.84 -> 20.19 GiB of
temporaries, 329 -> 233 GiB sent a chip a step; XLA:CPU's full step grows, docs/training.md). fp8 (BlockFP8) and
LoRA expert weights still enter gathered (their scales or adapters need their own split).
Expert counts (routing-bias update, balance loss) and drops
are the only global quantities: a psum over the token axes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from MaxText.kernels import backend
from MaxText.kernels import moe_experts as experts_lib
from MaxText.kernels.fp8_blocks import BlockFP8, block_of, shape_of
from MaxText.kernels.moe_experts import ExpertLoRA, ExpertWeights, base_of
from MaxText.runtime.sharding import logical_to_spec

EXCHANGES = ("all_to_all", "ragged_all_to_all")


def exchange_impl(key: str) -> str:
  """moe_exchange: 'auto' is backend.py's moe_exchange: ragged_all_to_all on GPU / TPU and the
  fixed-capacity all_to_all on CPU (XLA:CPU, jax 0.10.2, does not implement ragged-all-to-all)."""
  return backend.choice("moe_exchange") if key == "auto" else key


class MeshMoEOutput(NamedTuple):
  """What moe_on_mesh returns; every count is over the whole global batch."""
  y: jax.Array  # [b,t,D] in x's dtype: the routed experts' weighted sum
  counts: jax.Array  # [E] int32: valid assignments per expert
  dropped: jax.Array  # [] int32: assignments past capacity
  balance_sum: jax.Array  # [] f32: sum over sequences of the balance-loss terms (0 unless balance)
  balance_seqs: jax.Array  # [] f32: sequences with real tokens (0 unless balance)
  ids: jax.Array  # [b,t,k] int32: the experts each token took


class Placement(NamedTuple):
  """How one MoE call lies on the mesh (all static)."""
  token_spec: P  # of x [b,t,D]
  token_axes: tuple  # mesh axes that shard the tokens
  expert_axis: str | None  # mesh axis that shards the experts (None: every device holds all)
  tensor_axis: str | None  # mesh axis that shards the experts' hidden dim
  ep: int  # size of expert_axis (1 if None)


def _axes_of(entry) -> tuple:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def placement(x_shape: tuple, wi_shape: tuple, mesh: Mesh, rules: dict) -> Placement:
  token_spec = logical_to_spec(("activation_batch", "activation_length", None), rules, mesh, x_shape)
  w_spec = logical_to_spec(("exp", None, "mlp"), rules, mesh, wi_shape)  # [E,D,I]; fsdp gathered
  token_axes = _axes_of(token_spec[0]) + _axes_of(token_spec[1])
  exp_axes, mlp_axes = _axes_of(w_spec[0]), _axes_of(w_spec[2])
  if len(exp_axes) > 1 or len(mlp_axes) > 1:
    raise ValueError(f"logical_axis_rules map 'exp' to {exp_axes} and 'mlp' to {mlp_axes}: the MoE dispatch "
                     f"supports one mesh axis for each")
  expert_axis = exp_axes[0] if exp_axes else None
  return Placement(token_spec, token_axes, expert_axis, mlp_axes[0] if mlp_axes else None,
                   mesh.shape[expert_axis] if expert_axis else 1)


def _zero_axes(w0, mesh: Mesh, rules: dict, pl: Placement) -> tuple:
  """The mesh axes that split a plain expert weight's model dim D as stored (logical "embed" after "exp" and
  "mlp" took theirs) and also split the tokens (so the gathered weight varies over no axis the output does not),
  for the shard_map to take it so and gather it inside; () for BlockFP8 or LoRA weights."""
  if not isinstance(w0, jax.Array | jax.ShapeDtypeStruct) or isinstance(w0, BlockFP8):
    return ()
  spec = logical_to_spec(("exp", "embed", "mlp"), rules, mesh, w0.shape)  # [E,D,I]
  return tuple(a for a in _axes_of(spec[1]) if a in pl.token_axes)  # the output varies over these anyway


def capacity(assignments: int, ep: int, capacity_factor: float) -> int:
  """Rows each device may send to each expert owner: C = ceil(cf * M / ep), or M (dropless) for cf = -1."""
  if capacity_factor < 0:
    return assignments
  return max(1, min(assignments, math.ceil(capacity_factor * assignments / ep)))


# ---------------------------------------------------------------- the two exchanges


def _exchange_fixed(rows, ids, dest, pos, kept, *, axis, ep, cap, compute):
  """Fixed-capacity slots: assignment a -> slot (dest_a, pos_a) of an [ep, C] buffer.

  rows = (x [T,D], token [M]): assignment a carries x[token[a]] (gathered only into its slot);
  ids [M] local expert ids, dest [M] owner device, pos [M] rank for that owner, kept [M].
  compute(rows [ep*C,D], ids [ep*C], valid [ep*C]) -> [ep*C,D] runs the owner's experts.
  Returns [M,D]: each assignment's expert output (garbage where not kept)."""
  x, token = rows
  slot = jnp.where(kept, dest * cap + pos, ep * cap)  # [M]; ep*C: nowhere (dropped by mode="drop")
  slot_token = jnp.zeros((ep * cap,), jnp.int32).at[slot].set(token, mode="drop")  # [ep*C]
  slot_ids = jnp.zeros((ep * cap,), jnp.int32).at[slot].set(ids, mode="drop")  # [ep*C] local expert
  slot_valid = jnp.zeros((ep * cap,), bool).at[slot].set(kept, mode="drop")  # [ep*C]
  send = jnp.where(slot_valid[:, None], x[slot_token], jnp.zeros((), x.dtype))  # [ep*C,D]

  a2a = lambda v: jax.lax.all_to_all(v.reshape((ep, cap) + v.shape[1:]), axis, 0, 0).reshape(v.shape)
  recv, recv_ids, recv_valid = a2a(send), a2a(slot_ids), a2a(slot_valid)  # [ep*C,...]: from each source
  out = compute(recv, recv_ids, recv_valid)  # [ep*C,D]
  back = a2a(out)  # [ep*C,D]: slot (d, c) holds the result of what this device put there
  return back[jnp.minimum(slot, ep * cap - 1)]  # [M,D] (garbage where not kept)


def _exchange_ragged(rows, ids, dest, pos, kept, *, axis, ep, cap, compute):
  """Compact rows sorted by destination; ragged_all_to_all writes each source's rows contiguously
  into the owner's [ep*C] buffer. Arguments and result as `_exchange_fixed`."""
  x, token = rows
  m = token.shape[0]
  sent = experts_lib.expert_counts(dest, ep, kept)  # [ep] rows to each destination
  in_off = jnp.cumsum(sent) - sent  # [ep] where each destination's rows start here
  row = jnp.where(kept, in_off[dest] + pos, m)  # [M]; m: nowhere
  row_token = jnp.zeros((m,), jnp.int32).at[row].set(token, mode="drop")  # [M]
  row_ids = jnp.zeros((m,), jnp.int32).at[row].set(ids, mode="drop")  # [M]
  send_valid = jnp.arange(m) < jnp.sum(sent)  # [M]
  send = jnp.where(send_valid[:, None], x[row_token], jnp.zeros((), x.dtype))  # [M,D]

  all_sent = jax.lax.all_gather(sent, axis)  # [ep(src), ep(dst)]
  me = jax.lax.axis_index(axis)
  recv_sizes = all_sent[:, me]  # [ep] rows from each source
  recv_off = jnp.cumsum(recv_sizes) - recv_sizes  # [ep] where each source's rows start here
  out_off = (jnp.cumsum(all_sent, axis=0) - all_sent)[me]  # [ep] where my rows start at each destination
  src_in_off = (jnp.cumsum(all_sent, axis=1) - all_sent)[:, me]  # [ep] where source s keeps its rows for me

  def there(v, buf_rows):
    buf = jnp.zeros((buf_rows,) + v.shape[1:], v.dtype)
    return jax.lax.ragged_all_to_all(v, buf, in_off, sent, out_off, recv_sizes, axis_name=axis)

  recv, recv_ids = there(send, ep * cap), there(row_ids, ep * cap)  # [ep*C,...]
  recv_valid = jnp.arange(ep * cap) < jnp.sum(recv_sizes)  # [ep*C]
  out = compute(recv, recv_ids, recv_valid)  # [ep*C,D]
  back = jax.lax.ragged_all_to_all(out, jnp.zeros((m,) + out.shape[1:], out.dtype), recv_off, recv_sizes,
                                   src_in_off, sent, axis_name=axis)  # [M,D] in send order
  return back[jnp.minimum(row, m - 1)]  # [M,D] (garbage where not kept)


# ---------------------------------------------------------------- the layer's entry point


def moe_on_mesh(x: jax.Array, token_valid: jax.Array, gate: jax.Array, bias: jax.Array, experts: ExpertWeights, *,
                route_fn, mesh: Mesh, rules: dict, capacity_factor: float, exchange: str, impl: str,
                balance: bool, precision=None, routed_experts: jax.Array | None = None) -> MeshMoEOutput:
  """DeepSeekMoE's routing and routed experts over the mesh, each device on its own tokens.

  x [b,t,D], token_valid [b,t] bool (padding: not routed, not counted), gate [D,E], bias [E] (the
  selection-only routing bias), experts: all E experts' weights (sharded as the rules say);
  route_fn(x [T,D] fp32, gate, bias[, routed_experts]) -> (weights [T,k], ids [T,k], scores [T,E]) is DeepSeekMoE.route;
  routed_experts [b,t,k] int32 or None: recorded experts (keep routing), sharded as the tokens.
  """
  wi_0, wi_1, wo = experts
  if exchange not in EXCHANGES:
    raise ValueError(f"moe exchange={exchange!r}: expected one of {EXCHANGES}")
  w0 = base_of(wi_0)
  num_experts = shape_of(w0)[0]
  pl = placement(x.shape, shape_of(w0), mesh, rules)
  if isinstance(w0, BlockFP8) and pl.tensor_axis is not None:  # each hidden shard must hold whole blocks
    hidden, tp = shape_of(w0)[2], mesh.shape[pl.tensor_axis]
    block = block_of(w0.values.shape, w0.scale.shape)[1]
    if hidden % (tp * block):
      raise ValueError(f"moe_mlp_dim={hidden} over {tp} '{pl.tensor_axis}' shards is not a whole number of "
                       f"weight_block_size blocks ({block}) per shard: fp8 expert scales cannot be split so")
  tok, tok2 = pl.token_spec, P(*pl.token_spec[:2])
  batch_axes, length_axes = _axes_of(tok[0]), _axes_of(tok[1])
  zero = _zero_axes(wi_0, mesh, rules, pl)  # mesh axes that split a plain expert weight's D, gathered inside
  w_in = P(pl.expert_axis, zero or None, pl.tensor_axis)  # [E,D,I]
  w_out = P(pl.expert_axis, pl.tensor_axis, zero or None)  # [E,I,D]

  def spec_of(w, spec):
    """An ExpertLoRA's parts as its base [E,K,N]: A [E,K,r] split as K, B [E,r,N] as N (a partial sum over a
    split K, as the base's, is added by the psum over `tensor` below)."""
    if not isinstance(w, ExpertLoRA):
      return spec
    return ExpertLoRA(spec, P(spec[0], spec[1], None), P(spec[0], None, spec[2]))
  exchange_fn = _exchange_ragged if exchange == "ragged_all_to_all" else _exchange_fixed
  tokens_over_experts = pl.expert_axis is not None and pl.expert_axis in pl.token_axes

  def local(x, token_valid, gate, bias, wi_0, wi_1, wo, routed_experts=None):
    # per device: x [b_l,t_l,D], token_valid [b_l,t_l], gate [D,E], bias [E], routed_experts [b_l,t_l,k] | None,
    # wi_0/wi_1 [E_l,D,I_l], wo [E_l,I_l,D] (float, or BlockFP8: the spec applies to values and scale)
    if zero:  # [E_l,D/z,I_l] -> [E_l,D,I_l] (and wo on its last dim): transposed, a reduce-scatter
      wi_0, wi_1 = (jax.lax.all_gather(w, zero, axis=1, tiled=True) for w in (wi_0, wi_1))
      wo = jax.lax.all_gather(wo, zero, axis=2, tiled=True)
    b_l, t_l, d = x.shape
    e_l = shape_of(base_of(wi_0))[0]
    n = b_l * t_l
    xf = x.reshape(n, d)  # [T_l,D]
    extra = () if routed_experts is None else (routed_experts.reshape(n, -1),)  # [T_l,k]
    weights, ids, scores = route_fn(xf.astype(jnp.float32), gate, bias, *extra)  # [T_l,k], [T_l,k], [T_l,E]
    k = ids.shape[-1]
    valid = jnp.broadcast_to(token_valid.reshape(n, 1), (n, k))  # [T_l,k]
    ffn = lambda rows, rid, rvalid: experts_lib.expert_outputs(
        rows, rid, ExpertWeights(wi_0, wi_1, wo), impl=impl, valid=rvalid, precision=precision)
    dropped = jnp.int32(0)
    if pl.ep == 1:
      out = ffn(xf, ids, valid)  # [T_l,k,D]
    elif not tokens_over_experts:  # tokens replicated over `expert`: run my experts, sum over the axis
      lo = jax.lax.axis_index(pl.expert_axis) * e_l
      mine = valid & (ids >= lo) & (ids < lo + e_l)  # [T_l,k]
      out = ffn(xf, ids - lo, mine)  # [T_l,k,D]: zeros where another device's expert
    else:
      m = n * k
      cap = capacity(m, pl.ep, capacity_factor)
      flat_valid = valid.reshape(m)  # [M]
      dest = jnp.where(flat_valid, ids.reshape(m) // e_l, pl.ep)  # [M] owner device; ep = not routed
      pos = experts_lib.rank_within(dest, pl.ep + 1)  # [M] rank among this device's rows for that owner
      kept = flat_valid & (pos < cap)  # [M]
      dropped = jnp.sum(flat_valid & ~kept).astype(jnp.int32)
      token = jnp.arange(m, dtype=jnp.int32) // k  # [M] the token of assignment t*k + j

      def compute(rows, rid, rvalid):  # rows [ep*C,D] received, rid local expert ids
        return ffn(rows, rid[:, None], rvalid[:, None])[:, 0]  # [ep*C,D]

      back = exchange_fn((xf, token), ids.reshape(m) % e_l, jnp.minimum(dest, pl.ep - 1), pos, kept,
                         axis=pl.expert_axis, ep=pl.ep, cap=cap, compute=compute)  # [M,D]
      out = jnp.where(kept[:, None], back, jnp.zeros((), back.dtype)).reshape(n, k, d)  # [T_l,k,D]
    y = experts_lib.combine(out, weights, precision)  # [T_l,D] fp32
    if pl.ep > 1 and not tokens_over_experts:
      y = jax.lax.psum(y, pl.expert_axis)
    if pl.tensor_axis is not None:
      y = jax.lax.psum(y, pl.tensor_axis)  # partial sums over the hidden dim I
    counts = experts_lib.expert_counts(ids, num_experts, valid)  # [E]
    if pl.token_axes:
      counts, dropped = jax.lax.psum((counts, dropped), pl.token_axes)
    terms = (jnp.float32(0), jnp.float32(0))
    if balance:  # per-sequence sums are additive over the sequence's shards, then over sequences
      stats = experts_lib.balance_stats(scores.reshape(b_l, t_l, -1), ids.reshape(b_l, t_l, k), token_valid)
      if length_axes:
        stats = jax.lax.psum(stats, length_axes)  # whole sequences: [b_l,E], [b_l,E], [b_l]
      terms = experts_lib.balance_loss_terms(*stats, k)
      if batch_axes:
        terms = jax.lax.psum(terms, batch_axes)
    return y.astype(x.dtype).reshape(b_l, t_l, d), counts, dropped, terms, ids.reshape(b_l, t_l, k)

  if zero:  # gathered and reduce-scattered in the compute dtype (expert_outputs casts to it at use anyway)
    wi_0, wi_1, wo = (w.astype(x.dtype) for w in (wi_0, wi_1, wo))
  args = (x, token_valid, gate, bias, wi_0, wi_1, wo)
  specs = (tok, tok2, P(), P(), spec_of(wi_0, w_in), spec_of(wi_1, w_in), spec_of(wo, w_out))
  if routed_experts is not None:
    args, specs = args + (routed_experts,), specs + (tok,)  # routed_experts [b,t,k] lies as x [b,t,D]
  # Under the pipeline's vmap over stages (spmd_axis_name="stage") jax 0.10's replication check sees the per-stage
  # sums as varying over `stage` while the batching rule gives them a stage axis: the check is off there alone.
  fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(tok, P(), P(), (P(), P()), tok),
                     check_vma=mesh.shape.get("stage", 1) == 1)
  y, counts, dropped, (balance_sum, balance_seqs), ids = fn(*args)
  return MeshMoEOutput(y, counts, dropped, balance_sum, balance_seqs, ids)
