"""The model's static choices for a step over a cache: which attention, the absorbed weights, how
many indexer heads to score at once. The serving engine (serving.py) runs the step itself: the
model's own call with a cache (Transformer(cache=cache_view.stack_views(...)), every layer's
MLA.attend_cached), over the paged pools.
"""

from __future__ import annotations

from MaxText.config.types import Config
from MaxText.kernels.cached_attention import absorbed_weights

STACKS = ("dense_layers", "moe_layers")  # the Transformer's layer stacks, in order


def default_attention(config: Config) -> str:
  """"sparse" when the model attends over the indexer's selection, else "dense"."""
  if config.use_indexer and config.indexer_training_stage != "dense_warmup":
    return "sparse"
  return "dense"


def step_head_chunk(config: Config, prefill_chunk: int, t: int) -> int:
  """Indexer heads scored at once for t new tokens per row. The indexer scores [b,t,S,chunk] per head
  chunk; a prefill chunk uses indexer_head_chunk, and fewer queries may use proportionally more heads
  at once (the same peak memory): a decode step (t=1) scores all heads in one matmul, far faster on CPU.
  serve_max_index_score_bytes caps the buffer further (MLA.attend_cached)."""
  return min(config.indexer_n_heads,
             max(config.indexer_head_chunk, config.indexer_head_chunk * prefill_chunk // t))


def model_absorbed_weights(model) -> dict:
  """{stack name: Absorbed [L,...] (scanned) or [Absorbed per layer]} for the model's stacks; None for a
  stack whose wkv_b is fp8 (weight_quantization=fp8_block)."""
  out = {}
  for name in STACKS:
    stack = getattr(model, name)
    if stack is None:
      continue
    layers = [stack.layers] if stack.scan else list(stack.layers)
    if layers[0].attention.wkv_b.kernel_scale is not None:  # fp8: no resident float copy; attend_cached
      out[name] = None  # dequantizes wkv_b inside the step, layer by layer
      continue
    split = [_absorbed(layer) for layer in layers]
    out[name] = split[0] if stack.scan else split
  return out


def mtp_absorbed_weights(model, depth: int = 0):
  """MTP module `depth`'s layer's Absorbed (the speculative drafter's), None for an fp8 wkv_b."""
  layer = model.mtp[depth].layer
  return None if layer.attention.wkv_b.kernel_scale is not None else _absorbed(layer)


def _absorbed(layer):  # the base wkv_b alone: an adapter is added apart in attend_cached (kernels/low_rank.py)
  a = layer.attention
  return absorbed_weights(a.wkv_b.kernel_value(), a.num_heads, a.nope, a.v_dim)


def compiled_outputs(compiled):
  """A compiled program's outputs as ShapeDtypeStructs with the shardings it gives them (nothing run)."""
  import jax
  return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s), compiled.out_info,
                      compiled.output_shardings)


def run_or_shape(fn, abstract: bool, *args):
  """fn(*args) (a jitted function); for an abstract engine (ShapeDtypeStruct args) what it would give,
  with its shardings, from the compiled program: nothing allocated."""
  return compiled_outputs(fn.lower(*args).compile()) if abstract else fn(*args)


__all__ = ["STACKS", "default_attention", "step_head_chunk", "model_absorbed_weights", "mtp_absorbed_weights",
           "compiled_outputs", "run_or_shape"]
