"""Creating, sharding, splitting and merging the model's state as plain pytrees.

The trainer, decoder and converter all hold the model as (graphdef, params, buffers):
`params` are the nnx.Param leaves (what the optimizer trains), `buffers` everything else
(the MoE routing biases), both as nested dicts of arrays, the format of our checkpoints.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from MaxText.checkpoint import orbax_state
from MaxText.config.types import Config
from MaxText.layers import lora
from MaxText.layers.models import Transformer
from MaxText.runtime import sharding


def abstract_model(config: Config):
  """(graphdef, abstract params, abstract buffers) with no memory: shapes and dtypes only."""
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(config.seed)))
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  return graphdef, params, buffers


def count_params(params_state) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params_state))


def param_bytes(params_state) -> int:
  """Bytes of the parameters (abstract or concrete): size x itemsize of every leaf, so fp8 block-quantized
  weights count 1 byte each plus their fp32 scales. E.g. the serving fit of the 671B model:
  param_bytes(abstract_model(config)[1]) with weight_quantization=fp8_block."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params_state))


def shardings_of(config: Config, mesh, params_state, buffers_state):
  """NamedShardings for (params, buffers) as pure dicts."""
  ps = sharding.state_shardings(params_state, config, mesh).to_pure_dict()
  bs = sharding.state_shardings(buffers_state, config, mesh).to_pure_dict()
  return ps, bs


def optimizer_shardings(opt_state, params, mesh, memory_kind: str | None = None):
  """Shardings for an optimizer state built from `params` (arrays or ShapeDtypeStructs with shardings):
  each moment takes the sharding of the parameter it mirrors (matched by its trailing dict-key path
  and shape), scalars and anything else are replicated. jit(tx.init) alone would replicate the
  moments (zeros depend on no input), so every device would hold the whole optimizer state.
  memory_kind: where every leaf lives (optimizers.state_memory_kind; None: the device)."""
  if memory_kind:
    on_device = optimizer_shardings(opt_state, params, mesh)
    return jax.tree.map(lambda s: s.with_memory_kind(memory_kind), on_device)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  by_path = {tuple(k.key for k in path): (a.shape, a.sharding)
             for path, a in jax.tree_util.tree_leaves_with_path(params)}

  def one(path, leaf):
    keys = []
    for k in reversed(path):  # the trailing run of dict keys: the parameter's own path
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    shape, sh = by_path.get(tuple(keys), (None, None))
    return sh if shape == tuple(leaf.shape) else replicated

  return jax.tree_util.tree_map_with_path(one, opt_state)


def init_optimizer(tx, params, mesh, memory_kind: str | None = None):
  """tx.init(params) on the mesh, every moment sharded like its parameter (in memory_kind: optimizer_shardings)."""
  shardings = optimizer_shardings(jax.eval_shape(tx.init, params), params, mesh, memory_kind)
  return jax.jit(tx.init, out_shardings=shardings)(params)


def abstract_on_mesh(config: Config, mesh):
  """(graphdef, params, buffers) as pure dicts of ShapeDtypeStructs carrying the shardings `create`
  gives the real ones: for ahead-of-time compiles (train_compile, serve_compile); nothing allocated."""
  graphdef, abs_params, abs_buffers = abstract_model(config)
  p_shard, b_shard = shardings_of(config, mesh, abs_params, abs_buffers)
  return (graphdef, orbax_state.abstract_like(abs_params.to_pure_dict(), p_shard),
          orbax_state.abstract_like(abs_buffers.to_pure_dict(), b_shard))


def create(config: Config, mesh, *, adapters_only: bool = False):
  """Random init, each parameter created directly with its sharding on the mesh.
  Returns graphdef, params, buffers (pure dicts) and their shardings. adapters_only: params hold only
  the LoRA adapters (as a random init draws them) and buffers nothing: XLA drops the rest of the init,
  so the base costs no memory (load_parameters then reads it)."""
  graphdef, abs_params, abs_buffers = abstract_model(config)
  p_shard, b_shard = shardings_of(config, mesh, abs_params, abs_buffers)
  if adapters_only:
    p_shard, b_shard = lora.split(p_shard)[0], {}

  def init():
    _, params, buffers = nnx.split(Transformer(config, rngs=nnx.Rngs(config.seed)), nnx.Param, ...)
    if adapters_only:
      return lora.split(params.to_pure_dict())[0], {}
    return params.to_pure_dict(), buffers.to_pure_dict()

  lowered = jax.jit(init, out_shardings=(p_shard, b_shard)).lower()
  # Init runs once: on the CPU, LLVM's optimizations cost ~3x the compile time of the
  # hundreds of small random-number kernels and buy nothing.
  options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
  params, buffers = lowered.compile(compiler_options=options)()
  return graphdef, params, buffers, (p_shard, b_shard)


def merge(graphdef, params, buffers) -> Transformer:
  return nnx.merge(graphdef, params, buffers)


def save_parameters(path: str, params, buffers) -> None:
  """The parameter-only checkpoint that convert_hf_checkpoint writes and load_parameters_path reads."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, {"params": params, "buffers": buffers}, force=True)
  ckptr.wait_until_finished()


def load_parameters(path: str, config: Config, mesh, report=print):
  """Restores params + buffers onto the mesh from a converter output, a run's checkpoints folder (its
  newest usable step), one step folder or its state subfolder; shapes must match the config.
  Returns graphdef, params, buffers and their shardings; `report` gets a line naming the folder read
  when `path` was not that folder itself. Under LoRA the checkpoint holds the base: the adapters are a
  fresh init (B = 0: the loaded model's output is the base's)."""
  graphdef, abs_params, abs_buffers = abstract_model(config)
  p_shard, b_shard = shardings_of(config, mesh, abs_params, abs_buffers)
  abs_base = lora.split(abs_params.to_pure_dict())[1]
  target = {
      "params": orbax_state.abstract_like(abs_base, lora.split(p_shard)[1]),
      "buffers": orbax_state.abstract_like(abs_buffers.to_pure_dict(), b_shard),
  }
  used, restored = orbax_state.restore_parameters(path, target, report=report)
  if os.path.normpath(used) != os.path.normpath(path):
    report(f"load_parameters_path={path}: params and buffers from {used}")
  params = restored["params"]
  if config.lora_rank:
    params = lora.join(create(config, mesh, adapters_only=True)[1], params)
  return graphdef, params, restored["buffers"], (p_shard, b_shard)


def load_or_create(config: Config, mesh, report=print):
  """The decode/serve parameters: load_parameters(load_parameters_path) when set (report as there), else a
  random init. -> (graphdef, params, buffers, source): source is the line the entry points print saying which
  (random parameters are named loudly: their output is noise)."""
  if not config.load_parameters_path:
    graphdef, params, buffers, _ = create(config, mesh)
    return graphdef, params, buffers, (f"RANDOM parameters (no load_parameters_path; seed={config.seed}): the output "
                                       "is noise, a smoke test")
  graphdef, params, buffers, _ = load_parameters(config.load_parameters_path, config, mesh, report=report)
  return graphdef, params, buffers, f"parameters from load_parameters_path={config.load_parameters_path}"
