"""LoRA tests' shared pieces: a small LoRA config and a few train steps on its mesh (tests/unit/test_lora.py,
tests/integration/test_lora_train.py)."""

import jax
import numpy as np

from MaxText import train
from MaxText.data import input_pipeline
from MaxText.runtime import sharding
from tests.conftest import make_config


def train_steps(cfg, steps: int):
  """(state before, state after `steps` steps of one batch, the last metrics) as numpy, on cfg's mesh."""
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, state_sharding, tx = train.init_state(cfg, mesh)
    first = jax.tree.map(np.asarray, state)
    batch = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg)))
    batch_sharding = train.batch_shardings(cfg, mesh, batch)
    step = train.jit_train_step(cfg, graphdef, tx, state_sharding, batch_sharding, mesh)
    for _ in range(steps):
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
    return first, jax.tree.map(np.asarray, state), metrics


# 2 layers (1 dense, 1 MoE), no MTP, no remat: the train step compiles in a fraction of the tiny model's time.
SMALL_LORA = dict(lora_rank=4, weight_block_size=(16, 16), max_target_length=16, max_prefill_length=8,
                  global_batch_size=2, warmup_steps=0, learning_rate=1e-2, num_decoder_layers=2,
                  first_num_dense_layers=1, mtp_num_layers=0, remat_policy="none")


def small_lora_config(**kw):
  """SMALL_LORA's Config with `kw` over it (make_config: one device)."""
  return make_config(**{**SMALL_LORA, **kw})


def small_lora_args(**kw) -> list[str]:
  """SMALL_LORA with `kw` over it as train.py's key=value arguments (one device), after configs/base.yml."""
  def text(v):
    if isinstance(v, bool):
      return str(v).lower()
    if isinstance(v, (tuple, list)):
      return "[" + ",".join(map(str, v)) + "]"
    return str(v)
  return ["configs/base.yml", "ici_data_parallelism=1", *(f"{k}={text(v)}" for k, v in {**SMALL_LORA, **kw}.items())]


def write_adapter_run(out_dir: str, name: str, seed: int, **keys) -> dict:
  """A LoRA run's folder as train.py with lora_rank writes it (<out_dir>/<name>/config.yml and checkpoints/1/state
  holding only the adapters), its adapters random (B too, so they change the output) -> the adapters (numpy)."""
  from MaxText.checkpoint import model_state, orbax_state, run_folder
  from MaxText.layers import lora
  cfg = make_config(**keys, base_output_directory=out_dir, run_name=name, enable_checkpointing=True,
                    async_checkpointing=False)
  rng = np.random.default_rng(seed)
  adapters = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.3).astype(np.float32),
                          lora.split(model_state.abstract_model(cfg)[1].to_pure_dict())[0])
  run_folder.RunFolder(cfg).write_config()
  manager = orbax_state.create_manager(cfg)
  orbax_state.save(manager, 1, {"params": adapters, "buffers": {}, "step": np.int32(1)}, {})
  orbax_state.finish(manager)
  return adapters
