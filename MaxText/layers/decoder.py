"""Decoder layers (dense and MoE), scanned layer stacks, and the multi-token-prediction module.

A stack of N identical layers is built with `nnx.vmap` (parameters stacked on a leading
"layers" axis) and run with `nnx.scan`, so compile time does not grow with depth; with
`scan_layers=false` the same layers run as a Python loop (handy for per-layer inspection).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.types import Config
from MaxText.layers.attention_mla import MLA
from MaxText.layers.linears import MLP, Linear
from MaxText.layers.moe import DeepSeekMoE
from MaxText.layers.normalizations import RMSNorm

# The checkpoint names the layers place (layers/attention_mla.py, layers/moe.py, layers/linears.py,
# kernels/moe_experts.py): MLA "query_proj" [b,t,h,nope+rope], "kv_latent" [b,s,kv_lora], "key_proj" and
# "value_proj" [b,s,h,nope|v], "attention_out" [b,t,h,v]; MoE "moe_gate_out" [b,t,E], "moe_expert_hidden" [R,moe_mlp],
# "moe_expert_out" [R,D], "moe_out" [b,t,D]; dense MLP "mlp_hidden" [b,t,mlp].
MLA_PROJ = ("query_proj", "kv_latent", "key_proj", "value_proj")
LAYER_OUTS = ("attention_out", "moe_out")
_cp = jax.checkpoint_policies
_HOST = dict(offload_src="device", offload_dst="pinned_host")

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass (the least memory)
    "minimal": _cp.checkpoint_dots_with_no_batch_dims,  # MaxText's: save every weight matmul's output
    "save_dot_except_mlp": _cp.save_any_names_but_these("moe_expert_hidden", "mlp_hidden"),
    "save_attention_out": _cp.save_only_these_names("attention_out"),
    # and the gather path's per-block selection and head probabilities (sparse_attention.SELECTION_NAME: at 32K
    # tokens, top-k 2048, 0.6 GB): the backward pass re-runs no block's indexer scores, top-k or attention forward
    "save_attention_selection": _cp.save_only_these_names("attention_out", "sparse_selection"),
    "save_qkv_proj": _cp.save_only_these_names(*MLA_PROJ),  # MLA's projections; the MoE recomputed
    "save_out_proj": _cp.save_only_these_names(*LAYER_OUTS),  # attention's and the MoE's outputs
    # the same names kept in host memory (jax memory kinds: the backend must have pinned_host)
    "offload_qkv_proj": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(MLA_PROJ), **_HOST),
    "offload_out_proj": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(LAYER_OUTS), **_HOST),
}


class DecoderLayer(nnx.Module):
  """x + MLA(RMSNorm(x)), then + MLP or DeepSeekMoE(RMSNorm(.))."""

  def __init__(self, config: Config, *, moe: bool, rngs: nnx.Rngs):
    self.moe = moe
    self.pre_attention_norm = RMSNorm(config.emb_dim, config)
    self.attention = MLA(config, rngs=rngs)
    self.pre_mlp_norm = RMSNorm(config.emb_dim, config)
    self.mlp = DeepSeekMoE(config, rngs=rngs) if moe else MLP(config, config.mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache=None,
               routed_experts: jax.Array | None = None):
    """x [b,t,D] -> (x [b,t,D], aux); with a cache (inference) aux also holds the new tokens'
    "cache_entries" (MLA.attend_cached). routed_experts [b,t,k] (an MoE layer's forced routing)."""
    h, aux = self.attention(self.pre_attention_norm(x), positions, segment_ids, cache=cache)  # [b,t,D]
    x = x + h
    if self.moe:
      m, moe_aux = self.mlp(self.pre_mlp_norm(x), segment_ids, routed_experts)
      aux.update(moe_aux)  # expert_load [E], load_balance_loss [], moe_dropped [], routed_experts [b,t,k]
    else:
      m = self.mlp(self.pre_mlp_norm(x))
    return x + m, aux


class LayerStack(nnx.Module):
  """`num_layers` DecoderLayers of one kind; returns the output and per-layer aux stacked [L,...]."""

  def __init__(self, config: Config, num_layers: int, *, moe: bool, rngs: nnx.Rngs):
    self.scan = config.scan_layers
    self.remat_policy = config.remat_policy
    if self.scan:
      @nnx.split_rngs(splits=num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def create(rngs):
        return DecoderLayer(config, moe=moe, rngs=rngs)
      self.layers = create(rngs)
    else:
      self.layers = nnx.List([DecoderLayer(config, moe=moe, rngs=rngs) for _ in range(num_layers)])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache=None,
               routed_experts: jax.Array | None = None, weights_after: jax.Array | None = None):
    """x [b,t,D] -> (x, aux leaves stacked [L,...]). cache (inference): the stack's CacheView with a
    leading L axis (scanned with the layers; a paged one's pools whole, CacheView.scan_parts), or a list
    of per-layer views; no remat then.
    routed_experts [L,b,t,k] int32: each MoE layer's forced routing (None: route freely).
    weights_after (the pipeline's iteration counter, layers/pipeline.py): each layer's weights pass an optimization
    barrier with it inside the layer's remat, so their fsdp gathers cannot be hoisted out of a loop around the
    stack, and the backward recomputes the barrier from the stored weights (outside the remat, its output, a new
    value every iteration, was saved once per iteration and layer: 3 x 1.48 GiB of bf16 expert weights on the
    671B's 21-layer 2-stage step)."""
    def fwd(layer, x, c, r):
      if weights_after is not None:
        graphdef, state = nnx.split(layer)
        layer = nnx.merge(graphdef, jax.lax.optimization_barrier((state, weights_after))[0])
      return layer(x, positions, segment_ids, cache=c, routed_experts=r)

    if self.remat_policy != "none" and cache is None:
      fwd = nnx.remat(fwd, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=not self.scan)
    if self.scan:
      # a paged view's pools pass whole (broadcast, read by layer index), the rest sliced: CacheView.scan_parts
      cache, whole = (cache, None) if cache is None else cache.scan_parts()

      @nnx.scan(in_axes=(nnx.Carry, 0, 0, None, 0), out_axes=(nnx.Carry, 0))
      def body(x, layer, c, whole, r):
        return fwd(layer, x, None if c is None else c.with_store(whole), r)
      return body(x, self.layers, cache, whole, routed_experts)  # x [b,t,D], aux leaves [L,...]
    auxes = []
    for i, layer in enumerate(self.layers):
      x, aux = fwd(layer, x, None if cache is None else cache[i], None if routed_experts is None else routed_experts[i])
      auxes.append(aux)
    if cache is not None:  # per-layer entries stay a list, like the per-layer caches
      entries = [a.pop("cache_entries") for a in auxes]
      return x, {**jax.tree.map(lambda *a: jnp.stack(a), *auxes), "cache_entries": entries}
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


class MTPModule(nnx.Module):
  """DeepSeek-V3 multi-token prediction depth k: h' = W [RMSNorm(emb(t_{i+k})); RMSNorm(h^{k-1}_i)],
  then one MoE decoder layer; the embedding and output head are the main model's (shared)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    d = config.emb_dim
    self.embed_norm = RMSNorm(d, config)
    self.hidden_norm = RMSNorm(d, config)
    self.projection = Linear(2 * d, d, config, axes=("mlp", "embed"), rngs=rngs, block_quantized=False)
    self.layer = DecoderLayer(config, moe=config.num_experts > 0, rngs=rngs)
    self.final_norm = RMSNorm(d, config)
    self.remat_policy = config.remat_policy

  def __call__(self, h_prev, next_emb, positions, segment_ids, cache=None):
    """h_prev, next_emb [b,t,D] -> (h [b,t,D] for the next depth, normed h for the head, aux). With a
    cache (inference: its layer's CacheView) the layer attends over it (MLA.attend_cached) and aux
    holds the new tokens' "cache_entries"."""
    cat = jnp.concatenate([self.embed_norm(next_emb), self.hidden_norm(h_prev)], axis=-1)  # [b,t,2D]
    def fwd(layer, x):
      return layer(x, positions, segment_ids, cache=cache)

    # as the stacks' layers: a 671B MoE layer's saved activations are ~30 GiB (no remat with a cache)
    if self.remat_policy != "none" and cache is None:
      fwd = nnx.remat(fwd, policy=REMAT_POLICIES[self.remat_policy])
    h, aux = fwd(self.layer, self.projection(cat))
    return h, self.final_norm(h), aux
