"""Linear layers with logical-axis annotations, and the SwiGLU MLP.

With weight_quantization=fp8_block a block-quantized weight (the linears DeepSeek's fp8 checkpoints
quantize) is two parameters: `<name>` in float8_e4m3fn and `<name>_scale` fp32, one scale per block of
weight_block_size (kernels/fp8_blocks.py); its matmul dequantizes it a chunk of blocks at a time
(fp8_blocks.matmul), never whole.

LoRA (layers/lora.py) is a property of a Linear: where lora_module_path matches, `lora_a` [in, r] and
`lora_b` [r, out] sit beside the (frozen) kernel and y = x W + (lora_alpha / r) (x A) B. A served model with
serve_lora_adapters holds them slot-stacked instead (`lora_slots`: A [n, in, r], B [n, r, out], the scale
folded into B), and each row of the batch adds its own slot's delta (layers/lora_rows.py). Either way the
adapter stays apart from the kernel (kernels/low_rank.py): x W and x A B are summed in fp32 and rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.config.types import Config
from MaxText.kernels import low_rank
from MaxText.kernels.fp8_blocks import BlockFP8, dequantize_if, matmul, quantize, scale_shape
from MaxText.kernels.low_rank import LowRank
from MaxText.layers import lora_rows

# "default" is None, not lax.Precision.DEFAULT: an explicit DEFAULT pins one bf16 pass on a TPU even under
# JAX_DEFAULT_MATMUL_PRECISION=highest or jax.default_matmul_precision (what the device tests set), None follows them.
PRECISION = {"default": None, "high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def param(rngs: nnx.Rngs, shape, axes: tuple[str, ...], config: Config, *, init=None) -> nnx.Param:
  """A parameter holding its logical axes (sharding.py maps them onto the mesh)."""
  assert len(shape) == len(axes), (shape, axes)
  init = init or jax.nn.initializers.normal(config.param_init_std)
  return nnx.Param(init(rngs.params(), shape, dtype_of(config.weight_dtype)), logical_axes=tuple(axes))


def kernel_block(config: Config) -> tuple[int, int]:
  """The (in, out) block of our [.., in, out] kernels: weight_block_size is HF's [out, in]."""
  out_block, in_block = config.weight_block_size
  return in_block, out_block


def fp8_params(rngs: nnx.Rngs, shape, axes: tuple[str, ...], config: Config) -> tuple[nnx.Param, nnx.Param]:
  """A block-quantized weight [..., in, out]: (values float8_e4m3fn [..., in, out], scale fp32
  [..., ceil(in/b_in), ceil(out/b_out)]), both carrying the weight's logical axes (a scale dimension
  the mesh does not divide is replicated). Initialized as `param`'s normal draw, quantized per block."""
  assert len(shape) == len(axes), (shape, axes)
  block = kernel_block(config)
  w = jax.nn.initializers.normal(config.param_init_std)(rngs.params(), shape, jnp.float32)
  q = quantize(w, block)
  assert q.scale.shape == scale_shape(shape, block)
  return nnx.Param(q.values, logical_axes=tuple(axes)), nnx.Param(q.scale, logical_axes=tuple(axes))


SCALE_SUFFIX = "_scale"  # a block-quantized weight `w` has its scales at `w_scale` beside it


def requantized(tree: dict, like: dict, block: tuple[int, int]) -> dict:
  """A params pure dict laid out as `like` (the params of the model a config builds, abstract or not).

  tree holds each weight float, or fp8 with `<name>_scale` beside it. Where `like` holds fp8 the
  weight comes out fp8: kept as it is, or quantized from float per (in, out) `block`; where `like`
  holds float it comes out float: as it is, or dequantized in fp32. Names and shapes are not
  checked here (hf_format.check_against does); dtypes of float weights are left to the caller."""
  out = {}
  for name, want in like.items():
    if name not in tree:
      continue  # missing: left to hf_format.check_against to name
    if isinstance(want, dict):
      out[name] = requantized(tree[name], want, block)
      continue
    if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in like:
      continue  # written with its weight
    have, scale = tree[name], tree.get(name + SCALE_SUFFIX)
    fp8 = name + SCALE_SUFFIX in like
    if fp8 and scale is None:
      q = quantize(jnp.asarray(have), block)
      out[name], out[name + SCALE_SUFFIX] = q.values, q.scale
    elif fp8:
      out[name], out[name + SCALE_SUFFIX] = have, scale
    else:
      out[name] = have if scale is None else dequantize_if(BlockFP8(jnp.asarray(have), jnp.asarray(scale)),
                                                           jnp.float32)
  return out


def dequantized(tree: dict) -> dict:
  """A params pure dict with every block-quantized weight (`<name>` fp8 with `<name>_scale` beside it) dequantized
  to fp32 and its scale dropped; every other leaf as it is (the float model's layout: a float export of an fp8
  base, hf_export.merged_parameters)."""
  out = {}
  for name, v in tree.items():
    if isinstance(v, dict):
      out[name] = dequantized(v)
    elif name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in tree:
      continue  # read with its weight
    elif name + SCALE_SUFFIX in tree:
      out[name] = np.asarray(dequantize_if(BlockFP8(jnp.asarray(v), jnp.asarray(tree[name + SCALE_SUFFIX])),
                                           jnp.float32))
    else:
      out[name] = v
  return out


def weight_params(rngs: nnx.Rngs, shape, axes: tuple[str, ...], config: Config, *, block_quantized: bool
                  ) -> tuple[nnx.Param, nnx.Param | None]:
  """A weight [..., in, out] as (values, scale): fp8 + scales (`fp8_params`) when the config asks for
  fp8_block and the weight is one DeepSeek's checkpoints quantize (block_quantized), else (`param`, None)."""
  if block_quantized and config.weight_quantization == "fp8_block":
    return fp8_params(rngs, shape, axes, config)
  return param(rngs, shape, axes, config), None


def stored(values: nnx.Param, scale: nnx.Param | None):
  """A weight as its matmul takes it: the float array, or BlockFP8 (values, scale) to dequantize there."""
  return values[...] if scale is None else BlockFP8(values[...], scale[...])


class Linear(nnx.Module):
  """y = x @ kernel, kernel [in, out]; computes in config.dtype at config.matmul_precision.

  block_quantized: one of the linears DeepSeek's fp8 checkpoints hold in fp8 (all but the output head,
  the MTP projection and the indexer's weights_proj); under weight_quantization=fp8_block such a kernel
  is float8_e4m3fn with `kernel_scale` [ceil(in/b_in), ceil(out/b_out)] fp32 beside it.
  """

  def __init__(self, in_features: int, out_features: int, config: Config, *, axes: tuple[str, str],
               rngs: nnx.Rngs, dtype=None, block_quantized: bool = True):
    self.kernel, self.kernel_scale = weight_params(rngs, (in_features, out_features), axes, config,
                                                  block_quantized=block_quantized)
    self.dtype = dtype or dtype_of(config.dtype)
    self.precision = PRECISION[config.matmul_precision]
    # The adapter, set by lora.add_adapters where lora_module_path matches: A [in, r], B [r, out], alpha / r.
    self.lora_a: nnx.Param | None = nnx.data(None)
    self.lora_b: nnx.Param | None = nnx.data(None)
    self.lora_scale = 0.0
    self.lora_slots = False  # True: A [n, in, r], B [n, r, out] stacked per served adapter (lora_rows.py)

  def weight(self, dtype=None) -> jax.Array:
    """The kernel [in, out] in dtype (default: the compute dtype), dequantized per block when fp8."""
    return dequantize_if(stored(self.kernel, self.kernel_scale), dtype or self.dtype)

  def kernel_value(self) -> jax.Array:
    """The base kernel [..., in, out] as a float array for code that reads it whole (MLA's absorbed wkv_b): as
    stored, or dequantized to the compute dtype when fp8. Never with the adapter in it: a bf16 W + A B rounds a
    small A B away (kernels/low_rank.py); the adapter is `low_rank`, added where the kernel is used."""
    return self.kernel[...] if self.kernel_scale is None else self.weight()

  def low_rank(self, rows: int) -> LowRank | None:
    """The adapter apart from the kernel, for `rows` rows of input (None without one): A [1, in, r] and B [1, r,
    out] times alpha / r; slot-stacked (serving), the adapters' slots 1 .. n-1 with each row's one-hot slot
    (lora_rows.slot_rows; B already holds each adapter's alpha / r)."""
    if self.lora_a is None:
      return None
    a, b = self.lora_a[...], self.lora_b[...]
    if self.lora_slots:  # A [n,in,r], B [n,r,out]: slot 0 (zeros) is never computed
      return LowRank(a[1:], b[1:], lora_rows.slot_rows(rows, a.shape[0]))
    return LowRank(a[None], (b.astype(jnp.float32) * self.lora_scale)[None])  # [1,in,r], [1,r,out]

  def __call__(self, x: jax.Array) -> jax.Array:
    w = stored(self.kernel, self.kernel_scale)
    lr = self.low_rank(x.shape[0])
    if lr is None:
      return matmul(x, w, self.dtype, self.precision)  # [..., out]
    y = matmul(x, w, self.dtype, self.precision, out_dtype=jnp.float32)  # [..., out] fp32, not yet rounded
    return (y + low_rank.delta(x, lr, self.dtype, self.precision)).astype(self.dtype)  # one rounding of W x + A B x


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), the dense layers' and the shared experts' MLP."""

  def __init__(self, config: Config, hidden: int, *, rngs: nnx.Rngs):
    d = config.emb_dim
    self.gate = Linear(d, hidden, config, axes=("embed", "mlp"), rngs=rngs)
    self.up = Linear(d, hidden, config, axes=("embed", "mlp"), rngs=rngs)
    self.down = Linear(hidden, d, config, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:  # [b,t,D] -> [b,t,D]
    hidden = checkpoint_name(jax.nn.silu(self.gate(x)) * self.up(x), "mlp_hidden")  # [b,t,hidden]
    return self.down(hidden)
