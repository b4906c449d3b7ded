"""Pipeline parallelism: the MoE layer stack cut into S stages over the `stage` mesh axis.

What runs where (the rule for DeepSeek's 3 dense + 58 MoE layers and MTP): only the MoE stack is
pipelined. The embedding, the dense layers, the final norm, the output head and the MTP module run
before and after it as without a pipeline, their weights on every stage alike (not split over `stage`)
and the batch's rows split over `stage` as over the other batch axes (activation_batch's rule), so each
stage's devices run them on their own share of the rows; the pipeline gathers its microbatches over
`stage` on entry (sharding.stage_local: inside, `stage` is the stages' axis alone). The MoE stack's L layers are S x n x R: stage s runs n layers
(num_layers_per_pipeline_stage) per pass, and R passes (circular repeats) go round the stages:

    layer l = (r * S + s) * n + j      r < R repeat, s < S stage, j < n layer within the stage

The parameters keep the stack's one layout, [L, ...] in layer order: checkpoints, decode, serving and
the HF export do not know about stages, and a run resumes under any stage count. The layer axis is
sharded over `stage` (logical "layers" -> stage): with R = 1 each stage's n layers live on its own
devices; with R > 1 the stored order is not the stage order, so every step moves (R-1)/R of the MoE
weights across stages (use R = 1 at scale).

The schedule (GPipe's forward order, MaxText's loop; the backward pass is its autodiff): the batch
is cut into M microbatches, and every iteration each stage runs its layers on one microbatch, all
stages at once (`jax.vmap` over the stage axis, sharded over `stage`), then every stage's output
moves one stage on (`to_next_stage`: a roll XLA lowers to a collective-permute). Stage s runs
microbatch-step k = i - s at iteration i (microbatch k mod M, repeat k div M), so

    iterations T = R * M + S - 1,   bubble = (S - 1) / (R * M + S - 1) of each stage's iterations

(idle iterations compute on a zero or stale input and are discarded). With R > 1 the last stage's
output feeds the first stage's next repeat directly, which takes M = S.

The layers' math is the decoder's own: a stage is the stack's LayerStack with its slice of the
stacked parameters (same scan, same remat). Aux outputs come back per layer in layer order, each the
mean over the M microbatches (as gradient accumulation averages them); keep-routing (routed_experts)
and caches are not pipelined.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.types import Config
from MaxText.layers.decoder import LayerStack
from MaxText.runtime.sharding import constrain, stage_local

MICRO = (None, "activation_batch", "activation_length", "activation_embed")  # [M,mb,t,D]
STAGED = ("activation_stage", "activation_batch", "activation_length", "activation_embed")  # [S,mb,t,D]


# ---- the only places data crosses stages
def to_next_stage(y: jax.Array) -> jax.Array:
  """y [S,...] sharded over `stage` -> stage s's output at s + 1 (the last stage's wraps to stage 0, which
  reads it only as the next repeat's input). A roll on the sharded axis: XLA emits one collective-permute."""
  return jnp.roll(y, 1, axis=0)  # [S,...]


def last_stage(y: jax.Array) -> jax.Array:
  """y [S,mb,t,D] -> the last stage's y[S-1] [mb,t,D], split over the batch axes alone (the pipeline's output,
  not split over `stage`: a broadcast from the last stage's devices)."""
  return constrain(y[-1], MICRO[1:])  # [mb,t,D]


# ---- layout: layer order <-> stages, batch <-> microbatches
def by_stage(a: jax.Array, stages: int, repeats: int) -> jax.Array:
  """A stacked parameter [L,...] (layer order) -> [S, R*n, ...]: stage s's layers, repeat-major."""
  n = a.shape[0] // (stages * repeats)
  a = a.reshape((repeats, stages, n) + a.shape[1:])  # [R,S,n,...]
  return jnp.moveaxis(a, 1, 0).reshape((stages, repeats * n) + a.shape[3:])  # [S,R*n,...]


def layer_order(a: jax.Array) -> jax.Array:
  """A per-layer value [S,R,n,...] -> [L,...] in layer order (l = (r*S + s)*n + j)."""
  a = jnp.moveaxis(a, 1, 0)  # [R,S,n,...]
  return a.reshape((-1,) + a.shape[3:])  # [L,...]


def to_microbatches(a: jax.Array, m: int) -> jax.Array:
  """[b,...] -> [M, b/M, ...]: microbatch i holds rows i, i+M, ...; a device's rows stay on it."""
  return jnp.moveaxis(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 1, 0)  # [M,mb,...]


def from_microbatches(a: jax.Array) -> jax.Array:
  """[M,mb,...] -> [b,...], the inverse of to_microbatches."""
  return jnp.moveaxis(a, 0, 1).reshape((-1,) + a.shape[2:])  # [b,...]


def bubble_fraction(config: Config) -> float:
  """The idle share of each stage's iterations: (S - 1) / (R*M + S - 1)."""
  s, m, r = config.pipeline_stages, config.pipeline_microbatches, config.pipeline_repeats
  return (s - 1) / (r * m + s - 1)


def run(stack: LayerStack, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, config: Config):
  """The MoE stack pipelined: x [b,t,D] -> (x [b,t,D], aux leaves [L,...] in layer order), as
  `stack(x, positions, segment_ids)` returns them (each aux the mean over microbatches). x's rows arrive split over
  `stage` too (activation_batch's rule: the embedding, dense layers and head run on a stage's share of the batch);
  the microbatches are gathered over `stage` on entry and the output split again on exit."""
  with stage_local():
    return _run(stack, x, positions, segment_ids, config)


def _run(stack: LayerStack, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, config: Config):
  s, m, r = config.pipeline_stages, config.pipeline_microbatches, config.pipeline_repeats
  n = config.layers_per_pipeline_stage
  graphdef, params = nnx.split(stack)
  staged = jax.tree.map(lambda a: by_stage(a, s, r), params)  # leaves [S,R*n,...]
  xs = constrain(to_microbatches(x, m), MICRO)  # [M,mb,t,D]
  pos = to_microbatches(positions, m)  # [M,mb,t]
  seg = None if segment_ids is None else to_microbatches(segment_ids, m)  # [M,mb,t]

  def stage(p, h, pos_s, seg_s, rep, i):
    """One stage: its n layers of repeat `rep` on h [mb,t,D] at iteration i. pipeline_fsdp_ag_once=false: each
    layer's weights pass a barrier with i (LayerStack weights_after), so each iteration gathers a layer's weights
    as the unpipelined stack does (hoisted out of the loop, XLA:TPU kept every layer's gathered experts live: the
    671B's 11-layer 2-stage step 48.14 -> 30.43 GiB of temporaries with the barrier). true: the compiler's choice,
    which may gather once and keep them."""
    if r > 1:  # R = 1: the stage's layers whole (a dynamic slice would copy them, and their gradient, per iteration)
      p = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, rep * n, n, 0), p)  # [n,...]
    y, aux = nnx.merge(graphdef, p)(h, pos_s, seg_s, weights_after=None if config.pipeline_fsdp_ag_once else i)
    aux.pop("routed_experts", None)  # [n,mb,t,k]: keep-routing is not pipelined
    return y, aux

  if r > 1:  # the repeat's weight slice varies by iteration: recompute it rather than keep one per iteration
    stage = jax.checkpoint(stage, policy=jax.checkpoint_policies.nothing_saveable)
  stages = jax.vmap(stage, in_axes=(0, 0, 0, None if seg is None else 0, 0, None), spmd_axis_name="stage")
  ids = jnp.arange(s)  # [S]

  def iteration(state, i_x):
    i, x_i = i_x  # [], [mb,t,D] stage 0's fresh microbatch at this iteration (zeros once none is left)
    k = i - ids  # [S] the microbatch-step each stage runs
    valid = (k >= 0) & (k < r * m)  # [S]
    k = jnp.clip(k, 0, r * m - 1)
    mb, rep = k % m, k // m  # [S], [S]
    fresh = (ids == 0) & (i < m)  # [S] stage 0 takes a new microbatch for the first M iterations
    h = constrain(jnp.where(fresh[:, None, None, None], constrain(x_i, MICRO[1:])[None], state), STAGED)
    y, aux = stages(staged, h, pos[mb], None if seg is None else seg[mb], rep, i)  # [S,mb,t,D], leaves [S,n,...]
    y = constrain(y, STAGED)
    return to_next_stage(y), (last_stage(y), aux, valid, rep)

  # The microbatches enter, and the last stage's outputs leave, as the loop's per-iteration inputs and outputs
  # ([T,mb,t,D], split over the batch axes), not as arrays the loop carries or closes over: the backward loop's
  # cotangent of a closed-over [M,mb,t,D] was left unsplit by XLA (every device held the whole batch's, 14 GiB a
  # TPU chip at the 671B's 2 stages x fsdp 16 x expert 8).
  iters = r * m + s - 1
  feed = jnp.concatenate([xs, jnp.zeros((iters - m,) + xs.shape[1:], xs.dtype)])  # [T,mb,t,D]
  init = constrain(jnp.zeros((s,) + xs.shape[1:], x.dtype), STAGED)
  _, (last, aux, valid, rep) = jax.lax.scan(iteration, init, (jnp.arange(iters), constrain(feed, MICRO)))
  out = last[s - 1 + (r - 1) * m:]  # [M,mb,t,D]: the last repeat's outputs, microbatch k at iteration S-1+(R-1)M+k
  # aux leaves [T,S,n,...] -> the mean over a layer's M valid iterations, [L,...] in layer order
  w = valid[..., None] * jax.nn.one_hot(rep, r) / m  # [T,S,R]
  per_layer = jax.tree.map(lambda a: layer_order(jnp.einsum("tsr,tsn...->srn...", w, a.astype(jnp.float32))), aux)
  return from_microbatches(constrain(out, MICRO)), per_layer
