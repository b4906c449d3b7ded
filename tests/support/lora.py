"""LoRA tests' shared pieces: a small LoRA config and a few train steps on its mesh (tests/unit/test_lora.py,
tests/integration/test_lora_train.py)."""

import jax
import numpy as np

from MaxText import train
from MaxText.data import input_pipeline
from MaxText.runtime import sharding
from tests.conftest import make_config


def train_steps(cfg, steps: int, history: list | None = None):
  """(state before, state after `steps` steps of one batch, the last metrics) as numpy, on cfg's mesh; each step's
  metrics (floats) appended to `history` when given."""
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, state_sharding, tx = train.init_state(cfg, mesh)
    first = jax.tree.map(np.asarray, state)
    batch = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg)))
    batch_sharding = train.batch_shardings(cfg, mesh, batch)
    step = train.jit_train_step(cfg, graphdef, tx, state_sharding, batch_sharding, mesh)
    for _ in range(steps):
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
      if history is not None:
        history.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    return first, jax.tree.map(np.asarray, state), metrics


def assert_same_step(got: dict, want: dict, cfg, rtol: float = 2e-4) -> None:
  """Two states after ONE step from the same start (train_steps), e.g. on two meshes: the gradients (Adam's first
  moment after one step, (1 - b1) g: linear in g) within rtol of each leaf's largest, and the params within rtol
  where the update is well conditioned. Adam's first step moves a parameter by lr g / (|g| + eps): where |g| is
  near eps (1e-8) a gradient's float rounding (another summation order on another mesh or CPU) becomes an O(lr)
  difference (a lora_b element 0.005493 vs 0.005488 at |g| ~ 1.2e-8 on one CI host), so params are compared
  elementwise where |g| > 100 eps (the update's relative error then under 1% of g's) or g is exactly 0 (no
  update: a lora_a under a zero lora_b), and within the update's bound, lr, elsewhere."""
  def moments(state):  # params' path -> the first moment (optax's ScaleByAdamState.mu over the trainable params)
    return {jax.tree_util.keystr(p).split(".mu", 1)[1]: np.asarray(a)
            for p, a in jax.tree_util.tree_leaves_with_path(state["opt_state"]) if ".mu[" in jax.tree_util.keystr(p)}

  mu_got, mu_want = moments(got), moments(want)
  assert mu_got.keys() == mu_want.keys() and mu_want
  for path, m in mu_want.items():
    np.testing.assert_allclose(mu_got[path], m, rtol=rtol, atol=rtol * float(np.max(np.abs(m))) + 1e-30,
                               err_msg=f"gradient {path}")
  well = {path: (np.abs(m) / (1 - cfg.adam_b1) > 100 * cfg.adam_eps) | (m == 0) for path, m in mu_want.items()}
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(got["params"]), jax.tree.leaves(want["params"])):
    path = jax.tree_util.keystr(p)
    a, b = np.asarray(a), np.asarray(b)
    mask = well.get(path, np.ones(a.shape, bool))  # a param with no moment (not trained): compared whole
    np.testing.assert_allclose(a[mask], b[mask], rtol=rtol, atol=2e-6, err_msg=path)
    np.testing.assert_allclose(a[~mask], b[~mask], atol=cfg.learning_rate, err_msg=path)


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
