"""A corrupt newest checkpoint falls back in one line and nothing reports after it (issue 46): the reads a
failed restore left in flight are ended inside the attempt (checkpoint/read_scope.py), for the train resume
(restore_newest_good) and the parameter-only load of load_parameters_path, decode and serve
(restore_parameters), and the export (hf_export.restore_raw). A tiny state sharded over the 8 test devices,
its newest step corrupted three ways and restored repeatedly (the race as it comes), then with lingering reads
(the race every time); then read_scope alone: on orbax's loop runner, nested, in two threads."""

import asyncio
import os
import shutil
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src import asyncio_utils

from MaxText.checkpoint import hf_export, orbax_state, read_scope
from tests.conftest import read_noise


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(pristine checkpoints folder with steps 1 and 2, the state of step 1, abstract state): 12 float32
  parameters, each sharded over 8 devices (96 reads in flight per restore), a buffer and a step."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rng = np.random.default_rng(0)
  host = {"params": {f"w{i}": rng.standard_normal((64, 32 * (i + 1)), np.float32) for i in range(12)},
          "buffers": {"bias": np.zeros((8,), np.float32)}, "step": np.int32(1)}
  folder = tmp_path_factory.mktemp("pristine") / "checkpoints"
  manager = ocp.CheckpointManager(str(folder), options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=True))
  states = {}
  for step in (1, 2):  # step 2's values differ from step 1's everywhere
    states[step] = jax.tree.map(lambda x, s=step: jax.device_put(x + (s - 1), split if x.ndim == 2 else whole), host)
    orbax_state.save(manager, step, states[step], {"position": step})
  manager.close()
  abstract = orbax_state.abstract_like(states[1], jax.tree.map(lambda a: a.sharding, states[1]))
  return folder, jax.device_get(states[1]), abstract


def _largest_data_file(step_dir):
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
           if os.sep + "d" + os.sep in os.path.join(d, f)]
  return max(files, key=os.path.getsize)


def _cut(path, keep):
  data = open(path, "rb").read()
  open(path, "wb").write(data[:keep(len(data))])


# name -> (corrupts a step folder in place, restores per test). Each makes the restore fail (none reads back
# wrong values). Before the fix, under load (2 cores, load 7-12), 3 restores in 40 were noisy with the data file
# cut to 1000 bytes, 13 in 40 cut in half (more reads in flight when one fails), 0 with the metadata cut (it fails
# before any read). The lingering-reads test below meets the race every time.
CORRUPTIONS = {
    "largest data file cut to 1000 bytes": (lambda d: _cut(_largest_data_file(d), lambda n: 1000), 2),
    "largest data file cut in half": (lambda d: _cut(_largest_data_file(d), lambda n: n // 2), 4),
    "tree metadata cut in half": (lambda d: _cut(os.path.join(d, "state", "_METADATA"), lambda n: n // 2), 1),
}


def _corrupt_copy(saved, tmp_path, how):
  folder = tmp_path / "run" / "checkpoints"
  shutil.rmtree(tmp_path / "run", ignore_errors=True)
  shutil.copytree(saved[0], folder)
  CORRUPTIONS[how][0](str(folder / "2"))
  return folder


def _resume(folder, abstract, report):
  """train.py's resume: -> (step restored, its params)."""
  manager = ocp.CheckpointManager(str(folder), options=ocp.CheckpointManagerOptions(create=True))
  try:
    step, state, data = orbax_state.restore_newest_good(manager, abstract, report=report)
  finally:
    manager.close()
  assert data == {"position": step}
  return step, state["params"]


def _load_parameters(folder, abstract, report):
  """load_parameters_path (train, decode, serve) given a run's checkpoints folder: -> (step read, its params)."""
  used, restored = orbax_state.restore_parameters(
      str(folder), {"params": abstract["params"], "buffers": abstract["buffers"]}, report=report)
  return int(os.path.basename(os.path.dirname(used))), restored["params"]


PATHS = {"train resume": (_resume, "checkpoint step 2 is unusable: it cannot be read"),
         "load_parameters_path": (_load_parameters, "load_parameters_path: {folder}/2/state is unusable")}


def _falls_back_quietly(saved, folder, said, path):
  """Restores the corrupt folder by `path`: step 1's values, one line naming step 2, nothing else said."""
  _, state1, abstract = saved
  restore, line = PATHS[path]
  lines = []
  step, params = restore(folder, abstract, lines.append)
  heard = said()
  assert step == 1, lines
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), state1["params"])
  assert len(lines) == 1 and lines[0].startswith(line.format(folder=folder)), lines
  assert not read_noise(heard), heard[:3000]


@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_a_corrupt_newest_step_falls_back_in_one_line_and_nothing_reports_after_it(saved, tmp_path, said, path, how):
  for _ in range(CORRUPTIONS[how][1]):
    _falls_back_quietly(saved, _corrupt_copy(saved, tmp_path, how), said, path)


@pytest.mark.parametrize("path", PATHS)
def test_reads_in_flight_when_one_fails_end_before_the_fallback(saved, tmp_path, said, lingering_reads, path):
  """The race made certain: each read that succeeds lingers, so when one fails its siblings are in flight."""
  _falls_back_quietly(saved, _corrupt_copy(saved, tmp_path, "largest data file cut in half"), said, path)


def test_an_export_of_a_corrupt_step_fails_in_one_line_and_nothing_reports_after_it(saved, tmp_path, said):
  """hf_export.restore_raw (numpy reads, no fallback): 9 in 10 were noisy before the fix."""
  for _ in range(2):
    folder = _corrupt_copy(saved, tmp_path, "largest data file cut in half")
    with pytest.raises(ValueError, match=r"^--checkpoint .*/2/state: restore failed \(ValueError: OUT_OF_RANGE"):
      hf_export.restore_raw(str(folder / "2" / "state"))
    heard = said()
    assert not read_noise(heard), heard[:3000]


def test_a_read_failing_while_a_sibling_is_in_flight_ends_the_sibling_before_it_returns(said):
  """orbax's own loop runner, one read failing while the other still waits: deterministic, no files."""
  sibling = []

  async def read():
    await asyncio.sleep(0.2)

  async def restore():
    sibling.append(asyncio.ensure_future(read()))
    await asyncio.sleep(0)
    raise ValueError("a truncated file")

  with read_scope.owned(), pytest.raises(ValueError, match="a truncated file"):
    asyncio_utils.run_sync(restore())
  assert sibling[0].cancelled()
  assert not read_noise(said())
  assert not isinstance(asyncio.get_event_loop_policy(), read_scope._OwningPolicy)  # the scope is undone


def test_a_cancelled_read_completing_after_its_loop_closed_is_dropped_quietly(said):
  """A TensorStore read is a future its own thread completes through loop.call_soon_threadsafe: cancelled
  with its task, it may still complete after the loop has closed (the export's numpy reads, 1 run in 6)."""
  completed = threading.Event()

  async def read():
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    def finish():  # TensorStore's thread, the read done 0.05 s later
      try:
        time.sleep(0.05)
        loop.call_soon_threadsafe(lambda: None if result.done() else result.set_result("shard"))
      finally:
        completed.set()

    threading.Thread(target=finish).start()
    return await result

  async def restore():
    asyncio.ensure_future(read())
    await asyncio.sleep(0)
    raise ValueError("a truncated file")

  with read_scope.owned(), pytest.raises(ValueError, match="a truncated file"):
    asyncio_utils.run_sync(restore())
  assert completed.wait(10)
  assert not read_noise(said())


def _ends_its_tasks_on_close() -> bool:
  """Whether a loop made here now cancels a task still sleeping when it is closed."""
  loop = asyncio.new_event_loop()
  task = loop.create_task(asyncio.sleep(10))
  loop.run_until_complete(asyncio.sleep(0))
  loop.close()
  return task.cancelled()


def test_the_scope_nests_and_holds_for_each_thread_inside_until_the_last_one_leaves():
  outside = asyncio.get_event_loop_policy()
  entered, left, seen = threading.Event(), threading.Event(), []

  def other():
    with read_scope.owned():
      entered.set()
      left.wait(10)
      seen.append(_ends_its_tasks_on_close())  # the main thread has left its scope by now

  thread = threading.Thread(target=other)
  with read_scope.owned():
    thread.start()
    entered.wait(10)
    with read_scope.owned():
      pass
    assert _ends_its_tasks_on_close()  # still inside the outer scope
  left.set()
  thread.join(10)
  assert seen == [True]
  assert asyncio.get_event_loop_policy() is outside
