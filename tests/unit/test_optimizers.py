"""The optimizer (runtime/optimizers.py): Adam moments stored in bf16 (opt_moments_dtype) keep optax's AdamW
math, halve the optimizer state, and train the tiny model along the f32-moment loss curve; the state kept in
host memory (optimizer_memory_host_offload) trains the same and resumes either way."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import train
from MaxText.config.types import ConfigError
from MaxText.data import input_pipeline
from MaxText.runtime import optimizers, sharding
from tests.conftest import make_config


def _grads(seed, shapes):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return {n: jax.random.normal(k, s) * 10.0 ** -(i % 4) for i, ((n, s), k) in enumerate(zip(shapes.items(), keys))}


@pytest.mark.parametrize("stream", [False, True])
def test_the_moment_storing_adam_with_f32_storage_is_optax_adamw(stream):
  """stream: the moments kept in host memory between steps and streamed through the update a parameter at a
  time (optimizer_memory_host_offload), the update jitted as the train step runs it."""
  cfg = make_config(opt_moments_dtype="bfloat16")
  shapes = {"w": (8, 4), "b": (4,), "e": (3, 2, 5)}  # a mix of scales: 1, 0.1, 0.01
  params = _grads(99, shapes)
  ours = optax.chain(optimizers.scale_by_adam_stored_as(cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, jnp.float32, stream),
                     optax.add_decayed_weights(cfg.adam_weight_decay),
                     optax.scale_by_learning_rate(optimizers.learning_rate_schedule(cfg)))
  theirs = optax.adamw(optimizers.learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                       weight_decay=cfg.adam_weight_decay)
  s_ours, s_theirs, p_ours, p_theirs = ours.init(params), theirs.init(params), params, params
  update = ours.update
  if stream:
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    moments = lambda st: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: host if optimizers.streamed(path) else x.sharding, st)
    s_ours = jax.device_put(s_ours, moments(s_ours))
    update = jax.jit(lambda g, st, p: ours.update(g, optimizers.on_device(make_config(
        optimizer_memory_host_offload=True), st), p), out_shardings=(None, moments(s_ours)))
  for step in range(12):
    g = _grads(step, shapes)
    u_ours, s_ours = update(g, s_ours, p_ours)
    u_theirs, s_theirs = theirs.update(g, s_theirs, p_theirs)
    p_ours, p_theirs = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_theirs, u_theirs)
  for k in shapes:
    np.testing.assert_allclose(p_ours[k], p_theirs[k], rtol=1e-6, atol=1e-7)


def test_the_streamed_update_moves_one_parameters_moments_onto_the_device_at_a_time():
  """Each parameter's moments leave host memory through an optimization barrier that also takes the previous
  parameter's new moments moved back to host memory: the device never holds two parameters' moments."""
  from tests.support.kernels import jaxpr_eqns
  shapes = {"w": (8, 4), "b": (4,), "e": (3, 2, 5)}
  adam = optimizers.scale_by_adam_stored_as(0.9, 0.95, 1e-8, jnp.bfloat16, stream=True)
  params = _grads(0, shapes)
  jaxpr = jax.make_jaxpr(adam.update)(params, adam.init(params)).jaxpr
  to_device, to_host, barriers = [], [], []
  for eqn, _ in jaxpr_eqns(jaxpr):
    if eqn.primitive.name == "device_put":
      (to_device if eqn.params["devices"][0] == jax.memory.Space.Device else to_host).append(eqn)
    elif eqn.primitive.name == "optimization_barrier":
      barriers.append(eqn)
  assert len(to_device) == len(to_host) == len(barriers) == len(shapes)
  for i, (barrier, put) in enumerate(zip(barriers, to_device)):
    assert [str(v) for v in put.invars] == [str(v) for v in barrier.outvars[:2]]  # the moments, through the barrier
    previous = [] if i == 0 else [str(v) for v in to_host[i - 1].outvars]
    assert [str(v) for v in barrier.invars[2:]] == previous  # ... after the previous parameter's are stored back


def test_bf16_moments_are_stored_in_bf16_and_take_half_the_bytes():
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
  def state_bytes(dtype):
    st = optimizers.create_optimizer(make_config(opt_moments_dtype=dtype)).init(params)
    return sum(x.nbytes for x in jax.tree.leaves(st) if x.ndim), st
  f32, _ = state_bytes("float32")
  bf16, st = state_bytes("bfloat16")
  adam = st[1][0]  # chain(clip, chain(scale_by_adam, decay, lr)) -> ScaleByAdamState
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
  assert bf16 * 2 == f32


def test_a_moments_dtype_outside_the_two_is_one_line_naming_the_key():
  with pytest.raises(ConfigError) as e:
    make_config(opt_moments_dtype="float16")
  assert "opt_moments_dtype" in str(e.value) and "bfloat16" in str(e.value) and "\n" not in str(e.value)


def _loss_curve(moments: str, steps: int, **keys) -> np.ndarray:
  return _run(moments, steps, **keys)[0]


def _run(moments: str, steps: int, **keys):
  cfg = make_config(opt_moments_dtype=moments, steps=steps, enable_checkpointing=False, enable_tensorboard=False, **keys)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, state_sharding, tx = train.init_state(cfg, mesh)
    data = input_pipeline.create_data_iterator(cfg, process_index=0, process_count=1)
    first = train.prepare_batch(cfg, next(data))
    step_fn = train.jit_train_step(cfg, graphdef, tx, state_sharding, train.batch_shardings(cfg, mesh, first), mesh)
    losses, batch = [], first
    for _ in range(steps):
      state, metrics = step_fn(state, batch)
      losses.append(float(metrics["loss"]))
      batch = train.prepare_batch(cfg, next(data))
    data.close()
  return np.asarray(losses), state


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_optimizer_state_offloaded_to_host_trains_the_same_and_lives_there_between_steps(moments):
  ref = _loss_curve(moments, 4)
  off, state = _run(moments, 4, optimizer_memory_host_offload=True)
  np.testing.assert_allclose(off, ref, rtol=1e-6)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"])} == {"device"}
  _, kept = _run("float32", 1)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(kept["opt_state"])} == {"device"}  # the default


def test_the_offloaded_step_moves_the_optimizer_state_to_the_device_for_its_update_and_back():
  cfg = make_config(optimizer_memory_host_offload=True)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    state, batch, step = train.abstract_train_step(cfg, mesh)
    text = step.lower(state, batch).as_text()
  assert text.count('_xla_buffer_placement = "device"') > 0  # optimizers.on_device: read on the device
  assert text.count('_xla_buffer_placement = "pinned_host"') == len(jax.tree.leaves(state["opt_state"]))  # back


@pytest.mark.slow
def test_a_run_resumes_with_its_optimizer_state_in_host_memory_or_on_the_device(tmp_path, capsys):
  """Saved from host memory; resumed into host memory and onto the device: the same next step."""
  keys = dict(steps=2, checkpoint_period=2, log_period=1, base_output_directory=str(tmp_path), run_name="run",
              enable_tensorboard=False, async_checkpointing=False, optimizer_memory_host_offload=True)
  train.train(make_config(**keys))
  shutil.copytree(tmp_path / "run", tmp_path / "device")
  keys["steps"] = 3
  host = train.train(make_config(**keys))
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  device = train.train(make_config(**dict(keys, run_name="device", optimizer_memory_host_offload=False)))
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  assert host["loss"] == pytest.approx(device["loss"], rel=1e-6)
  assert host["grad_norm"] == pytest.approx(device["grad_norm"], rel=1e-6)
