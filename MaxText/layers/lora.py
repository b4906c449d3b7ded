"""LoRA (Hu et al. 2021, arXiv 2106.09685): low-rank adapters beside frozen linears; QLoRA when the frozen
base is DeepSeek's fp8 block-quantized release (weight_quantization=fp8_block).

A Linear y = x W, W [in, out], whose path fully matches lora_module_path gets

    A [in, r]   uniform(-1/sqrt(in), 1/sqrt(in))   (peft's and MaxText's kaiming-uniform init)
    B [r, out]  zeros
    y = x W + (lora_alpha / r) (x A) B              r = lora_rank

A kernel narrower than lora_rank (min(in, out) < r: a rank-r update of it is full rank) is refused when
lora_module_path names it, and left out, said in one line by train.py (`skipped`), when lora_module_path is
base.yml's default: at lora_rank 8 the tiny model's indexer weights_proj [64, 4] keeps no adapter, the 671B's
[7168, 64] does. A requested rank is never silently another.

B = 0 makes the adapted model's output equal the base's at step 0. A and B are float32 whatever
weight_dtype is (they are what trains: QLoRA's fp32 adapters over a bf16/fp8 base), cast to the compute
dtype in the matmul. Stacked (scanned) layers carry
stacked adapters [L, in, r], [L, r, out]. A's input axis and B's output axis are the kernel's logical
axes, the rank axis is `lora_rank`, which base.yml maps to the ZeRO-3 axes (fsdp, context, expert) that the
other side left free: A [in, r] is sharded as its kernel's input, B [r, out] on its rank (a mesh axis is used
once per array), so no adapter is whole on every device; its optimizer moments follow.

The paths are the linears' module paths, e.g. `dense_layers/layers/attention/wq_a`,
`moe_layers/layers/mlp/shared_experts/down`, `moe_layers/layers/attention/indexer/wk`,
`mtp/0/layer/attention/wo`, `output_head`. The routed experts (`moe_layers/layers/mlp/wi_0`, `wi_1`, `wo`,
[E, in, out] each) are not Linears: where the regex matches one, moe.ExpertAdapter `<w>_lora` beside it holds
per-expert A [E, in, r] (uniform as above) and B [E, r, out] (zeros), applied inside the experts' grouped matmul
and sharded over the expert axis as the experts are (logical axes: the kernel's, the rank `lora_rank`).

In the trainer the params pure dict is split by name: `adapters` (every `lora_a` / `lora_b` leaf: what
the optimizer trains and a checkpoint holds) and `base` (everything else, frozen); `join` is the inverse.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config import pyconfig
from MaxText.config.types import Config, ConfigError
from MaxText.kernels.fp8_blocks import BlockFP8, dequantize, quantize
from MaxText.layers.linears import SCALE_SUFFIX, Linear
from MaxText.layers.moe import ADAPTER_SUFFIX, EXPERT_WEIGHTS, DeepSeekMoE, ExpertAdapter

ADAPTER_NAMES = ("lora_a", "lora_b")
_FOLD = re.compile(r"/\d+/")  # a path's layer index (unscanned stacks, MTP): folded to /<i>/ when naming paths


def linears(model: nnx.Module) -> list[tuple[str, Linear]]:
  """(module path 'a/b/c', Linear) of every Linear in the model, in graph order."""
  return [("/".join(str(p) for p in path), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, Linear)]


def routed_experts(model: nnx.Module) -> list[tuple[str, DeepSeekMoE, str]]:
  """(path 'a/b/wi_0', the MoE layer, weight name) of every routed-expert weight, in graph order."""
  return [("/".join([*(str(p) for p in path), w]), node, w) for path, node in nnx.iter_graph(model)
          if isinstance(node, DeepSeekMoE) for w in EXPERT_WEIGHTS]


def _narrow(config: Config, shape) -> bool:
  """Whether a kernel [..., in, out] is narrower than lora_rank (a rank-r update of it would be full rank)."""
  return config.lora_rank > min(shape[-2:])


def _takes_narrow(config: Config, path: str, shape) -> bool:
  """Whether a kernel lora_module_path matched gets an adapter: yes unless narrower than lora_rank. base.yml's default
  lora_module_path then leaves it out (`skipped` names it: the indexer's weights_proj is indexer_n_heads wide, 4 on
  the tiny model); a lora_module_path set to anything else is a ConfigError naming it (a rank asked for is never
  silently another)."""
  if not _narrow(config, shape):
    return True
  if config.lora_module_path == pyconfig.default("lora_module_path"):
    return False
  n_in, n_out = shape[-2:]
  raise ConfigError(f"lora_rank={config.lora_rank} exceeds the smaller side of {path}'s kernel "
                    f"[{n_in}, {n_out}] (matched by lora_module_path={config.lora_module_path!r}): use "
                    f"lora_rank <= {min(n_in, n_out)} or a lora_module_path without it")


def matched_experts(model: nnx.Module, config: Config) -> list[tuple[str, DeepSeekMoE, str]]:
  """The routed-expert weights lora_module_path fully matches (narrow ones as for linears: `_takes_narrow`)."""
  pattern = re.compile(config.lora_module_path)
  return [(p, m, w) for p, m, w in routed_experts(model)
          if pattern.fullmatch(p) and _takes_narrow(config, p, getattr(m, w).shape)]


def matched(model: nnx.Module, config: Config) -> list[tuple[str, Linear]]:
  """The linears lora_module_path fully matches that get adapters; a ConfigError (one line) when it matches neither
  a linear nor a routed-expert weight, or when lora_rank exceeds the smaller side of a kernel it names (base.yml's
  default leaves such a kernel out instead: `skipped`)."""
  pattern = re.compile(config.lora_module_path)
  every = linears(model)
  named = [(p, m) for p, m in every if pattern.fullmatch(p)]
  if not named and not matched_experts(model, config):
    names = sorted({_FOLD.sub("/<i>/", p) for p, _ in every} | {p for p, _, _ in routed_experts(model)})
    raise ConfigError(f"lora_module_path={config.lora_module_path!r} matches no linear of this model; its linears "
                      f"are: {', '.join(names)}")
  return [(p, m) for p, m in named if _takes_narrow(config, p, m.kernel.shape)]


def skipped(model: nnx.Module, config: Config) -> list[str]:
  """The kernels base.yml's default lora_module_path matches but leaves without an adapter (narrower than
  lora_rank), as 'path [in, out]', scanned layers' indices folded: what train.py says in one line."""
  if not config.lora_rank or config.lora_module_path != pyconfig.default("lora_module_path"):
    return []
  pattern = re.compile(config.lora_module_path)
  kernels = [(p, m.kernel.shape) for p, m in linears(model)]
  kernels += [(p, getattr(m, w).shape) for p, m, w in routed_experts(model)]
  folded = (f"{_FOLD.sub('/<i>/', p)} {list(shape[-2:])}" for p, shape in kernels
            if pattern.fullmatch(p) and _narrow(config, shape))
  return list(dict.fromkeys(folded))


def add_adapters(model: nnx.Module, config: Config, rngs: nnx.Rngs) -> None:
  """Gives every linear lora_module_path matches its A and B (a no-op at lora_rank=0), then every routed-expert
  weight it matches its per-expert A and B. Called once the base is built, so the base's random draws (and
  values) are the same with and without adapters. With serve_lora_adapters (a served model): slot-stacked zeros,
  A [..., n, in, r], B [..., n, r, out], n = adapters + 1."""
  if not config.lora_rank:
    return
  r = config.lora_rank
  dtype = jnp.float32  # whatever weight_dtype says: adapters are the trained master copy (cast to dtype in the matmul)
  slots = len(config.serve_lora_adapters) + 1  # serving: slot 0 (none) and one per served adapter
  for _, m in matched(model, config):
    *stack, n_in, n_out = m.kernel.shape  # stack: [L] for a scanned layer's kernel
    in_axis, out_axis = m.kernel.get_metadata()["logical_axes"][-2:]
    if config.serve_lora_adapters:  # zeros, filled by checkpoint/lora_adapters.py (lora_rows.py: the layout)
      m.lora_a = nnx.Param(jnp.zeros((*stack, slots, n_in, r), dtype), logical_axes=("lora_slot", in_axis, "lora_rank"))
      m.lora_b = nnx.Param(jnp.zeros((*stack, slots, r, n_out), dtype), logical_axes=("lora_slot", "lora_rank", out_axis))
      m.lora_slots, m.lora_scale = True, 1.0  # each adapter's alpha / r is folded into its B
      continue
    bound = 1.0 / math.sqrt(n_in)
    a = jax.random.uniform(rngs.params(), (*stack, n_in, r), jnp.float32, -bound, bound)  # [..., in, r]
    m.lora_a = nnx.Param(a.astype(dtype), logical_axes=(in_axis, "lora_rank"))
    m.lora_b = nnx.Param(jnp.zeros((*stack, r, n_out), dtype), logical_axes=("lora_rank", out_axis))  # [..., r, out]
    m.lora_scale = config.lora_alpha / r
  experts = matched_experts(model, config)
  if experts and config.serve_lora_adapters:
    raise ConfigError(f"serve_lora_adapters: lora_module_path={config.lora_module_path!r} adapts the routed experts "
                      f"({experts[0][0]}, ...): per-row expert adapters are not served; serve such an adapter merged "
                      "into its base (export_hf_checkpoint --lora merged)")
  for _, moe, name in experts:
    w = getattr(moe, name)
    *stack, e, n_in, n_out = w.shape  # [.., E, in, out]
    exp_axis, in_axis, out_axis = w.get_metadata()["logical_axes"][-3:]
    bound = 1.0 / math.sqrt(n_in)
    a = jax.random.uniform(rngs.params(), (*stack, e, n_in, r), jnp.float32, -bound, bound)  # [.., E, in, r]
    setattr(moe, name + ADAPTER_SUFFIX, ExpertAdapter(
        nnx.Param(a, logical_axes=(exp_axis, in_axis, "lora_rank")),
        nnx.Param(jnp.zeros((*stack, e, r, n_out), dtype), logical_axes=(exp_axis, "lora_rank", out_axis)),
        config.lora_alpha / r))


def is_adapter(path) -> bool:
  """Whether a pytree path (of a params pure dict) ends in an adapter's A or B."""
  last = path[-1]
  return str(getattr(last, "key", last)) in ADAPTER_NAMES


def _partition(tree: dict, keep_adapters: bool) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      sub = _partition(v, keep_adapters)
      if sub:
        out[k] = sub
    elif (k in ADAPTER_NAMES) == keep_adapters:
      out[k] = v
  return out


def split(params: dict) -> tuple[dict, dict]:
  """A params pure dict -> (adapters: only the lora_a / lora_b leaves, base: all the others), both nested
  as params (an empty branch is left out)."""
  return _partition(params, True), _partition(params, False)


def join(a: dict, b: dict) -> dict:
  """The union of two nested dicts without common leaves (the inverse of `split`)."""
  out = dict(b)
  for k, v in a.items():
    out[k] = join(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def merged(base: dict, adapters: dict, scale: float, block: tuple[int, int]) -> dict:
  """The base params pure dict (stacked or per layer, float or fp8 with `kernel_scale` beside the kernel) with
  each adapter merged into its kernel: W + scale * A B, in fp32 (A [..., in, r], B [..., r, out]); a routed-expert
  adapter `<w>_lora` into the expert weight `<w>` [..., E, in, out] beside it, expert by expert. An fp8 kernel is
  dequantized, merged and quantized again per (in, out) `block`: the merged weight rounds to e4m3. A float kernel
  keeps its dtype. `adapters` is nested as `base` (what `split` gives)."""
  out = dict(base)
  for k, sub in adapters.items():
    if not isinstance(sub, dict):
      continue
    if "lora_a" not in sub:
      out[k] = merged(base[k], sub, scale, block)
      continue
    if k in base:  # a Linear: {"kernel", "kernel_scale"?}
      node, name = dict(base[k]), "kernel"
    else:  # a routed-expert weight's adapter: the weight is `k` without the suffix, in this same dict
      node, name = out, k[:-len(ADAPTER_SUFFIX)]
    scales = node.get(name + SCALE_SUFFIX)
    w = np.asarray(node[name] if scales is None else dequantize(BlockFP8(jnp.asarray(node[name]),
                                                                         jnp.asarray(scales))), np.float32)
    ab = np.einsum("...ir,...ro->...io", np.asarray(sub["lora_a"], np.float32), np.asarray(sub["lora_b"], np.float32))
    if ab.shape != w.shape:
      raise ValueError(f"the adapter of {k} gives a [{', '.join(map(str, ab.shape))}] update to a kernel of "
                       f"[{', '.join(map(str, w.shape))}]: are lora_rank and the model keys the run's?")
    w = w + np.float32(scale) * ab  # [..., in, out]
    if scales is None:
      node[name] = w.astype(np.asarray(node[name]).dtype)
    else:
      q = quantize(jnp.asarray(w), block)
      node[name], node[name + SCALE_SUFFIX] = np.asarray(q.values), np.asarray(q.scale)
    if node is not out:
      out[k] = node
  return out
