"""The DeepSeek-V3.2 Transformer: embed -> dense layers -> MoE layers -> RMSNorm -> logits (+ MTP),
and its losses (LM cross-entropy with padding ignored, z-loss, MTP)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config.types import Config
from MaxText.layers import lora, pipeline
from MaxText.layers.decoder import LayerStack, MTPModule
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import Linear
from MaxText.layers.normalizations import RMSNorm
from MaxText.runtime.sharding import constrain

ACTIVATION = ("activation_batch", "activation_length", "activation_embed")  # [b,t,D]


class Transformer(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = Embed(config, rngs=rngs)
    n_dense, n_moe = config.first_num_dense_layers, config.num_moe_layers
    self.dense_layers = LayerStack(config, n_dense, moe=False, rngs=rngs) if n_dense else None
    self.moe_layers = LayerStack(config, n_moe, moe=True, rngs=rngs) if n_moe else None
    self.final_norm = RMSNorm(config.emb_dim, config)
    self.output_head = Linear(config.emb_dim, config.vocab_size, config, axes=("embed", "vocab"), rngs=rngs,
                              block_quantized=False)
    self.mtp = nnx.List([MTPModule(config, rngs=rngs) for _ in range(config.mtp_num_layers)])
    lora.add_adapters(self, config, rngs)  # last: the base draws the same keys with and without adapters

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, mtp_tokens: jax.Array | None = None, *,
               cache: dict | None = None, last_index: jax.Array | None = None,
               routed_experts: jax.Array | None = None):
    """tokens [b,t] -> (logits [b,t,V] fp32, aux).

    Inference passes `cache`, {stack name: its CacheView} (inference/cache_view.py): each layer
    attends over its cache plus the new tokens (MLA.attend_cached), no MTP runs, and aux is
    {"cache_entries": {stack name: the new tokens' entries}, "hidden": the last layer's output
    [b,t,D] (what MTP depth 1 reads, see `mtp_cached`)}; last_index [b] keeps only the logits at
    that index of each row ([b,1,V]), last_index [b,m] those at m indices ([b,m,V]).

    positions are the ORIGINAL token positions (context parallelism may reorder the sequence);
    mtp_tokens [n_mtp,b,t]: depth k's input token at each position (token i+k of the original
    order, see `mtp_inputs`); None computes it by shifting `tokens`, valid only in original order.
    aux: indexer_loss (mean over layers), expert_load [L_moe,E], load_balance_loss (sum over
    layers), moe_dropped (mean over MoE layers of the fraction of assignments past capacity), mtp_logits [n_mtp,b,t,V] (depth k at position i predicts token i+k+1) or None.

    Keep routing (RL): routed_experts [b,t,L_moe,k] int32 forces each MoE layer of the stack to take
    those experts (gate weights from the current router; a token whose ids are -1 routes freely:
    layers/moe.py `route`); None routes as usual. With MoE layers, aux["routed_experts"] [b,t,L_moe,k]
    is what each took (with a cache too): jit drops it when the caller does not keep it.
    """
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    if cache is not None:
      return self._cached(tokens, positions, cache, last_index)
    if routed_experts is not None:
      routed_experts = jnp.moveaxis(routed_experts, 2, 0)  # [b,t,L,k] -> [L,b,t,k]: scanned with the layers
    if mtp_tokens is None and self.mtp:
      mtp_tokens = jnp.stack([jnp.roll(tokens, -k, axis=1) for k in range(1, len(self.mtp) + 1)])
    x = constrain(self.embed(tokens), ACTIVATION)  # [b,t,D]
    indexer_losses, aux = [], {}
    if self.dense_layers is not None:
      x, a = self.dense_layers(x, positions, segment_ids)
      indexer_losses.append(a["indexer_loss"])
    if self.moe_layers is not None:
      if self.config.pipeline_stages > 1:  # the MoE stack in stages (layers/pipeline.py): no keep-routing
        if routed_experts is not None:
          raise ValueError("routed_experts (keep routing) with ici_pipeline_parallelism x dcn_pipeline_parallelism > 1:"
                           " the pipeline does not carry forced routing; train RL without pipeline stages")
        x, a = pipeline.run(self.moe_layers, x, positions, segment_ids, self.config)
      else:
        x, a = self.moe_layers(x, positions, segment_ids, routed_experts=routed_experts)
        aux["routed_experts"] = jnp.moveaxis(a["routed_experts"], 0, 2)  # [L,b,t,k] -> [b,t,L,k]
      indexer_losses.append(a["indexer_loss"])
      aux["expert_load"] = a["expert_load"]  # [L_moe, E]
      aux["load_balance_loss"] = jnp.sum(a["load_balance_loss"])
      aux["moe_dropped"] = jnp.mean(a["moe_dropped"])  # fraction of assignments past capacity
    logits = self.logits(self.final_norm(x))  # [b,t,V]

    mtp_logits, mtp_loads = [], []
    h = x
    for k, module in enumerate(self.mtp, start=1):
      # Depth k at position i sees the embedding of token i+k (the shifted-in tail is ignored by the loss).
      next_emb = constrain(self.embed(mtp_tokens[k - 1]), ACTIVATION)  # [b,t,D]
      h, h_normed, a = module(h, next_emb, positions, segment_ids)
      indexer_losses.append(a["indexer_loss"][None])
      if "load_balance_loss" in a:
        aux["load_balance_loss"] = aux.get("load_balance_loss", 0.0) + a["load_balance_loss"]
        mtp_loads.append(a["expert_load"])
      mtp_logits.append(self.logits(h_normed))
    aux["mtp_logits"] = jnp.stack(mtp_logits) if mtp_logits else None
    aux["mtp_expert_load"] = jnp.stack(mtp_loads) if mtp_loads else None  # [n_mtp,E]
    aux["indexer_loss"] = jnp.mean(jnp.concatenate(indexer_losses)) if indexer_losses else jnp.float32(0)
    return logits, aux


  def _cached(self, tokens, positions, cache: dict, last_index):
    x = constrain(self.embed(tokens), ACTIVATION)  # [b,t,D]
    entries, out = {}, {}
    for name in ("dense_layers", "moe_layers"):
      stack = getattr(self, name)
      if stack is not None:
        x, a = stack(x, positions, None, cache=cache[name])
        entries[name] = a["cache_entries"]
        if "routed_experts" in a:
          out["routed_experts"] = jnp.moveaxis(a["routed_experts"], 0, 2)  # [L,b,t,k] -> [b,t,L,k]
    return self.logits(self.final_norm(_rows_at(x, last_index))), {"cache_entries": entries, "hidden": x, **out}

  def mtp_cached(self, h: jax.Array, next_tokens: jax.Array, positions: jax.Array, cache, depth: int = 0,
                 last_index: jax.Array | None = None):
    """Inference through MTP module `depth` with its own cache (speculative decoding's drafter):
    h [b,t,D] (the last layer's output at each position, or a previous MTP pass's h), next_tokens
    [b,t] (token i+1 at position i) -> (logits [b,t,V], or at last_index as __call__, the module's h
    [b,t,D] for a chained pass, the new tokens' cache entries). As training's depth-1 step: the
    logits at position i predict token i+2."""
    next_emb = constrain(self.embed(next_tokens), ACTIVATION)  # [b,t,D]
    h, h_normed, aux = self.mtp[depth](h, next_emb, positions, None, cache=cache)
    return self.logits(_rows_at(h_normed, last_index)), h, aux["cache_entries"]

  def logits(self, h: jax.Array) -> jax.Array:
    """h [b,t,D] (normed) -> logits [b,t,V] fp32, sharded like the activations (vocab over tensor)."""
    logits = self.output_head(constrain(h, ACTIVATION)).astype(jnp.float32)  # [b,t,V]
    return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


def _rows_at(x: jax.Array, index: jax.Array | None) -> jax.Array:
  """x [b,t,D] -> x at index [b] ([b,1,D]) or [b,m] ([b,m,D]); None: all of x."""
  if index is None:
    return x
  index = index[:, None] if index.ndim == 1 else index  # [b,m]
  return jnp.take_along_axis(x, index[:, :, None], axis=1)  # [b,m,D]


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss_weight: float = 0.0):
  """Mean token cross-entropy over weights > 0; logits [b,t,V] fp32, targets/weights [b,t].
  Returns (loss incl. z-loss, lm loss, z-loss)."""
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [b,t]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [b,t]
  nll = log_z - target_logit
  denom = jnp.maximum(jnp.sum(weights), 1.0)
  lm = jnp.sum(nll * weights) / denom
  z = z_loss_weight * jnp.sum(jnp.square(log_z) * weights) / denom
  return lm + z, lm, z


def token_accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Weighted fraction of tokens whose argmax logit is the target; logits [b,t,V], targets/weights [b,t]."""
  hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [b,t]
  return jnp.sum(hit * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def mtp_inputs(tokens: np.ndarray, targets: np.ndarray, weights: np.ndarray, segment_ids: np.ndarray | None,
               n: int) -> dict:
  """What MTP depth k = 1..n needs, computed on the host (numpy: no device is touched, so an ahead-of-time compile
  for devices this process lacks builds its batch too) in ORIGINAL sequence order (before any reordering):
  mtp_tokens [n,b,t] (token i+k), mtp_targets [n,b,t] (token i+k+1 = targets[i+k]) and
  mtp_weights [n,b,t] (valid only inside the sequence and in the same document as i)."""
  tokens, targets, weights = np.asarray(tokens), np.asarray(targets), np.asarray(weights)
  t = tokens.shape[1]
  toks, tgts, ws = [], [], []
  for k in range(1, n + 1):
    toks.append(np.roll(tokens, -k, axis=1))  # [b,t]
    tgts.append(np.roll(targets, -k, axis=1))
    w = np.roll(weights, -k, axis=1) * (np.arange(t) < t - k)[None, :]  # the wrapped tail is invalid
    if segment_ids is not None:
      segment_ids = np.asarray(segment_ids)
      w = w * (np.roll(segment_ids, -k, axis=1) == segment_ids)
    ws.append(w.astype(weights.dtype))
  return {"mtp_tokens": np.stack(toks), "mtp_targets": np.stack(tgts), "mtp_weights": np.stack(ws)}


def mtp_loss(mtp_logits: jax.Array, mtp_targets: jax.Array, mtp_weights: jax.Array) -> jax.Array:
  """Mean over depths of each depth's cross-entropy; [n,b,t,V] logits, [n,b,t] targets/weights."""
  return jnp.mean(jnp.stack([cross_entropy(mtp_logits[k], mtp_targets[k], mtp_weights[k])[1]
                             for k in range(mtp_logits.shape[0])]))
