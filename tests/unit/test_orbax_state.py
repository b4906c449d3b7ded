"""checkpoint/orbax_state's fingerprint: the one check that sees a corruption leaving every value finite."""

import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint import orbax_state


def test_one_low_mantissa_bit_in_any_leaf_changes_the_fingerprint_and_nothing_else():
  rng = np.random.default_rng(0)
  tree = {"params": {"w": rng.standard_normal((4, 8)).astype(np.float32),
                     "e": rng.standard_normal((8,)).astype(jnp.bfloat16)},
          "opt": {"count": np.int32(7), "mu": rng.standard_normal((3,)).astype(np.float32)}}
  fingerprint, finite = orbax_state.state_check(tree)
  assert bool(finite)
  uint = {2: np.uint16, 4: np.uint32}
  for path, flip in [(("params", "w"), 13), (("params", "e"), 5), (("opt", "count"), 0), (("opt", "mu"), 0)]:
    leaf = np.asarray(tree[path[0]][path[1]])
    bits = leaf.view(uint[leaf.dtype.itemsize]).copy()
    bits.reshape(-1)[flip] ^= 1  # the lowest mantissa bit of one value: still finite, all but equal
    changed = {**tree, path[0]: {**tree[path[0]], path[1]: bits.view(leaf.dtype).reshape(leaf.shape)}}
    got, still_finite = orbax_state.state_check(changed)
    assert bool(still_finite) and int(got) != int(fingerprint), path
    assert orbax_state._check_restored(changed, {"fingerprint": int(fingerprint)}).startswith(
        "its contents do not match the fingerprint"), path
  assert orbax_state._check_restored(tree, {"fingerprint": int(fingerprint)}) is None


def _saved(tmp_path, state):
  """A checkpoint manager over tmp_path holding `state` as step 1 (synchronous writes)."""
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=True))
  orbax_state.save(manager, 1, state, {"cursor": 0})
  manager.wait_until_finished()
  return manager


def _abstract(state):
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def test_resume_checks_the_saved_fingerprint_and_sets_aside_a_checkpoint_that_fails_it(tmp_path):
  state = {"params": {"w": np.arange(8, dtype=np.float32)}, "buffers": {}, "step": np.int32(1)}
  manager = _saved(tmp_path, state)
  step, restored, data = orbax_state.restore_newest_good(manager, _abstract(state), report=lambda line: None)
  assert step == 1 and data == {"cursor": 0} and np.array_equal(restored["params"]["w"], state["params"]["w"])
  meta = tmp_path / "checkpoints" / "1" / "meta" / "metadata"
  meta.write_text(meta.read_text().replace(str(int(orbax_state.state_check(state)[0])), "12345"))
  lines = []
  try:
    orbax_state.restore_newest_good(manager, _abstract(state), report=lines.append)
    raise AssertionError("a checkpoint whose fingerprint does not match was resumed")
  except orbax_state.CheckpointError:
    pass
  assert len(lines) == 1 and "do not match the fingerprint" in lines[0], lines
  assert (tmp_path / orbax_state.UNUSABLE_DIR / "1").is_dir()


def test_resuming_with_the_other_weight_quantization_names_it(tmp_path):
  from MaxText.config.types import ConfigError
  fp8 = {"params": {"wo": {"kernel": np.zeros((4, 4), np.float32), "kernel_scale": np.ones((1, 1), np.float32)}},
         "buffers": {}}
  plain = {"params": {"wo": {"kernel": np.zeros((4, 4), np.float32)}}, "buffers": {}}
  for saved, target, have, want in [(fp8, plain, "fp8_block", "none"), (plain, fp8, "none", "fp8_block")]:
    manager = _saved(tmp_path / have, saved)
    try:
      orbax_state.restore_newest_good(manager, _abstract(target), report=lambda line: None)
      raise AssertionError("resumed across weight_quantization")
    except ConfigError as e:
      assert f"weight_quantization={have}" in str(e) and f"weight_quantization={want}" in str(e), e


def test_a_parameter_load_checks_the_parameters_fingerprint_of_a_step(tmp_path):
  """load_parameters_path reads params + buffers only, so it checks their own fingerprint (saved beside the
  whole state's): a step whose parameters do not match it is refused in one line, the step before it used."""
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=True))
  states = {s: {"params": {"w": np.arange(8, dtype=np.float32) * s}, "buffers": {"b": np.ones(2, np.float32)},
                "opt": {"mu": np.zeros(3, np.float32)}} for s in (1, 2)}
  for s, state in states.items():
    orbax_state.save(manager, s, state, {"cursor": s})
  manager.wait_until_finished()
  target = _abstract(orbax_state.parameters_of(states[1]))
  used, restored = orbax_state.restore_parameters(str(tmp_path), target, report=lambda line: None)
  assert used.endswith("2/state") and np.array_equal(restored["params"]["w"], states[2]["params"]["w"])
  meta = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
  saved = int(orbax_state.state_check(orbax_state.parameters_of(states[2]))[0])
  meta.write_text(meta.read_text().replace(str(saved), "12345"))  # as a garbled-but-finite parameter would
  lines = []
  used, restored = orbax_state.restore_parameters(str(tmp_path), target, report=lines.append)
  assert used.endswith("1/state") and np.array_equal(restored["params"]["w"], states[1]["params"]["w"])
  assert len(lines) == 1 and "2/state is unusable: its contents do not match the fingerprint" in lines[0], lines


def test_a_step_whose_parameter_files_are_garbled_but_finite_is_refused_by_a_parameter_load(tmp_path):
  """The arrays of step 2 replaced by other finite values (step 1's files, as a copy from the wrong run
  or a torn rsync would leave them; its meta untouched): every value is finite, only the fingerprint
  tells. A load of the run falls back to step 1 with one line; a load of step 2 alone is refused."""
  import shutil

  import orbax.checkpoint as ocp
  import pytest
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=True))
  states = {s: {"params": {"w": np.arange(8, dtype=np.float32) * s + 1}, "buffers": {"b": np.full(2, s, np.float32)},
                "opt": {"mu": np.zeros(3, np.float32)}} for s in (1, 2)}
  for s, state in states.items():
    orbax_state.save(manager, s, state, {"cursor": s})
  manager.wait_until_finished()
  step1, step2 = tmp_path / "checkpoints" / "1" / "state", tmp_path / "checkpoints" / "2" / "state"
  shutil.rmtree(step2)
  shutil.copytree(step1, step2)  # finite values, the wrong ones
  target = _abstract(orbax_state.parameters_of(states[1]))
  lines = []
  used, restored = orbax_state.restore_parameters(str(tmp_path), target, report=lines.append)
  assert used == str(step1) and np.array_equal(restored["params"]["w"], states[1]["params"]["w"])
  assert len(lines) == 1 and f"{step2} is unusable: its contents do not match the fingerprint" in lines[0], lines
  with pytest.raises(orbax_state.CheckpointError) as e:
    orbax_state.restore_parameters(str(step2.parent), target, report=lines.append)
  assert "no usable parameters" in str(e.value) and "fingerprint" in str(e.value) and "\n" not in str(e.value)
