"""One program, many processes (jax.distributed on localhost, CPU collectives over gloo): 2 processes
x 4 CPU devices train exactly like 1 process x 8 devices on grain data (an ArrayRecord text shard, a
worker per process reading only its own rows' documents), on a data=8 mesh (its checkpoint resumes in
1 process) and through the expert-parallel MoE on data=2 x context=2 x expert=2 (both processes killed
with -9 resume; their checkpoint resumes in a 1-process run on another mesh); a ragged decode equals
1 process; bad distributed keys fail in seconds with one line naming the key; a failing process ends
them all.

Every subprocess has a timeout (a hung peer fails the test, not CI) and shares one persistent
compilation cache, so a program compiled once is not compiled again by a later run; the reference
run and the killed run happen once per session, also under pytest-xdist (a file lock)."""

import fcntl
import json
import os
import re
import shutil
import time

import pytest

from tests.conftest import REPO_ROOT
from tests.support.train_processes import finish as _finish
from tests.support.train_processes import kill_after_checkpoint
from tests.support.train_processes import launch as _launch
from tests.support.train_processes import losses as _losses
from tests.support.train_processes import ok as _ok

STEPS = 20
TRAIN = ["configs/base.yml", f"steps={STEPS}", "log_period=1", "checkpoint_period=4", "async_checkpointing=false",
         "enable_tensorboard=false", "num_decoder_layers=2", "mtp_num_layers=0", "max_target_length=32",
         "global_batch_size=8", "warmup_steps=3"]
EP_MESH = ["ici_data_parallelism=2", "ici_context_parallelism=2", "ici_expert_parallelism=2"]


def _session_dir(tmp_path_factory):
  """A folder every xdist worker of this session shares (the base temp dir without xdist)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory, name, compute):
  """compute() run once per session across xdist workers; its JSON result is kept in the shared folder."""
  root = _session_dir(tmp_path_factory)
  with open(root / f"multiprocess_{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    path = root / f"multiprocess_{name}.json"
    if not path.exists():
      path.write_text(json.dumps(compute(root)))
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def grain_data(tmp_path_factory):
  """Train keys reading the test corpus from an ArrayRecord shard (made once per session), one grain worker."""
  def make(root):
    from array_record.python.array_record_module import ArrayRecordWriter

    from MaxText.data.documents import read_documents
    path = str(root / "multiprocess_corpus.arrayrecord")
    docs, _ = read_documents(os.path.join(REPO_ROOT, "tests", "data", "corpus.txt"), "text")
    w = ArrayRecordWriter(path, "group_size:1")
    for d in docs:
      w.write(d.encode())
    w.close()
    return path

  path = _once(tmp_path_factory, "corpus", make)
  return ["dataset_type=grain", f"grain_train_files={path}", "grain_worker_count=1",
          f"tokenizer_path={os.path.join(REPO_ROOT, 'tests', 'data', 'tokenizer.model')}"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  path = _session_dir(tmp_path_factory) / "multiprocess_jax_cache"
  path.mkdir(exist_ok=True)
  return str(path)


def _int_keys(d: dict) -> dict[int, float]:
  return {int(k): v for k, v in d.items()}


def _assert_losses_equal(got: dict, want: dict):
  assert got, "no losses printed"
  for s, loss in got.items():
    # The console prints 4 decimals, and 2 processes sum gradients in another order than 1: equal losses
    # round apart by one unit of the last place (6.23165 -> 6.2317 / 6.2316), and drift to 2e-4 by step 20
    # on an AVX2 host (5.1066 vs 5.1068); a real difference (a lost or doubled row) is far larger.
    assert loss == pytest.approx(want[s], abs=3.01e-4), (s, loss, want[s])


@pytest.fixture(scope="module")
def killed_and_resumed(cache_dir, tmp_path_factory, grain_data):
  """2 processes x 4 devices on data=2 x context=2 x expert=2, grain data (a worker each): both killed
  with -9 once checkpoint 8 is complete, then the same command again. (losses before the kill, the
  rerun's stdout, the checkpoint the rerun resumed from, its run dir)."""
  before, rerun, latest, run_dir = _once(tmp_path_factory, "killed_and_resumed", _kill_and_resume(cache_dir, grain_data))
  return _int_keys(before), rerun, latest, run_dir


def _kill_and_resume(cache_dir, grain_data):
  def run(root):
    return _kill_and_resume_in(root / "ep", cache_dir, grain_data)
  return run


def _kill_and_resume_in(base, cache_dir, grain_data):
  args = TRAIN + EP_MESH + grain_data + [f"base_output_directory={base}", "run_name=run"]
  ckpt = base / "run" / "checkpoints"
  first, latest = kill_after_checkpoint(_launch("train.py", args, processes=2, devices=4, cache=cache_dir), ckpt, 8,
                                        STEPS)
  (_, rerun, _), (_, silent, _) = _ok(_finish(_launch("train.py", args, processes=2, devices=4, cache=cache_dir)))
  assert silent.strip() == "", "process 1 printed to stdout: only process 0 speaks"
  return _losses(first[0]), rerun, latest, str(base / "run")


@pytest.mark.slow
def test_two_processes_train_like_one_through_expert_parallel_moe_and_resume_after_kill(grain_reference,
                                                                                       killed_and_resumed):
  before, rerun, latest, _ = killed_and_resumed
  assert f"resumed from checkpoint step {latest}" in rerun
  after = _losses(rerun)
  assert sorted(after) == list(range(latest + 1, STEPS + 1))
  assert set(before) | set(after) == set(range(1, STEPS + 1))  # every step seen, on 2 processes
  _assert_losses_equal(before, grain_reference)
  _assert_losses_equal(after, grain_reference)


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_in_one_process_on_another_mesh(grain_reference, grain_data,
                                                                          killed_and_resumed, cache_dir, tmp_path):
  *_, run_dir = killed_and_resumed
  shutil.copytree(run_dir, tmp_path / "run")
  ckpt = tmp_path / "run" / "checkpoints"
  for d in os.listdir(ckpt):  # keep 12: the 1-process run resumes there (data=8, not the EP mesh)
    if d.isdigit() and int(d) > 12:
      shutil.rmtree(ckpt / d)
  (_, out, _), = _ok(_finish(_launch("train.py", TRAIN + grain_data + [f"base_output_directory={tmp_path}",
                                                                      "run_name=run"],
                                     processes=1, devices=8, cache=cache_dir)))
  assert "resumed from checkpoint step 12" in out
  after = _losses(out)
  assert sorted(after) == list(range(13, STEPS + 1))
  _assert_losses_equal(after, grain_reference)


@pytest.fixture(scope="module")
def grain_reference(cache_dir, tmp_path_factory, grain_data):
  """Losses of steps 1..20 of one process with 8 devices (data=8) on the ArrayRecord shard."""
  def run(root):
    (rc, o, e), = _ok(_finish(_launch("train.py", TRAIN + grain_data + [f"base_output_directory={root}/grain_ref",
                                                                        "enable_checkpointing=false"],
                                      processes=1, devices=8, cache=cache_dir)))
    return _losses(o)

  losses = _int_keys(_once(tmp_path_factory, "grain_reference", run))
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses


@pytest.mark.slow
def test_two_processes_on_a_data_mesh_equal_one_process_and_one_writes_events(grain_reference, grain_data, cache_dir,
                                                                               tmp_path):
  """Each process packs only its own rows' documents (grain data, a worker each): the same losses as
  1 process; its checkpoint (every process's lane cursors) resumes in 1 process exactly."""
  args = TRAIN + grain_data + [f"base_output_directory={tmp_path}", "run_name=run"]
  (_, out, _), _ = _ok(_finish(_launch("train.py", args + ["enable_tensorboard=true"], processes=2, devices=4,
                                       cache=cache_dir)))
  losses = _losses(out)
  assert sorted(losses) == list(range(1, STEPS + 1))
  _assert_losses_equal(losses, grain_reference)
  assert len(os.listdir(tmp_path / "run" / "tensorboard")) == 1  # process 0's events file only
  ckpt = tmp_path / "run" / "checkpoints"
  for d in os.listdir(ckpt):
    if d.isdigit() and int(d) > 12:
      shutil.rmtree(ckpt / d)
  (_, out, _), = _ok(_finish(_launch("train.py", args, processes=1, devices=8, cache=cache_dir)))
  assert "resumed from checkpoint step 12" in out
  after = _losses(out)
  assert sorted(after) == list(range(13, STEPS + 1))
  _assert_losses_equal(after, grain_reference)


@pytest.mark.slow
def test_ragged_decode_with_two_processes_equals_one(cache_dir):
  # 8 ragged rows on data=8: each device holds a row, each process half of them
  args = ["configs/base.yml", "prompt=1,5,7,9|1,3|4,4,4,4,4,4,4|9,8,7|1|2,3,4,5,6|7,7|8,1,8,1,8,1",
          "max_prefill_length=16", "max_target_length=24", "num_decoder_layers=2", "mtp_num_layers=0"]
  (_, one, _), = _ok(_finish(_launch("decode.py", args, processes=1, devices=8, cache=cache_dir)))
  (_, two, _), (_, silent, _) = _ok(_finish(_launch("decode.py", args, processes=2, devices=4, cache=cache_dir)))
  rows = re.findall(r"^row \d+ ids: .*$", one, re.M)
  assert len(rows) == 8
  assert re.findall(r"^row \d+ ids: .*$", two, re.M) == rows
  assert silent.strip() == ""


# ---------------------------------------------------------------- bad input: one line, non-zero, no hang


def _one_line_error(err: str) -> str:
  """The one `config error:` line of a run's stderr (and no traceback)."""
  lines = [ln for ln in err.splitlines() if ln.startswith("config error:")]
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  return lines[0]


@pytest.mark.parametrize("per_process,keys", [
    # the counts disagree: process 0 says so to both
    ({0: ["distributed_num_processes=3"]}, ("distributed_num_processes", "distributed_num_processes")),
    # two processes with id 1, none with 0: neither finds a coordinator
    ({0: ["distributed_process_id=1"]}, ("distributed_coordinator_address", "distributed_coordinator_address")),
    # id 2 of 2: process 1 stops at once; process 0 waits for it until the timeout
    ({1: ["distributed_process_id=2"]}, ("distributed_num_processes", "distributed_process_id")),
], ids=["count_differs", "no_process_0", "id_out_of_range"])
def test_bad_process_ids_or_counts_fail_fast_naming_the_key(per_process, keys, cache_dir):
  t0 = time.time()
  results = _finish(_launch("train.py", TRAIN, processes=2, devices=4, cache=cache_dir, per_process=per_process,
                            timeout_s=5), timeout=120)
  for (rc, _, err), key in zip(results, keys):
    assert rc == 2, err[-3000:]
    assert key in _one_line_error(err)
  assert time.time() - t0 < 90


def test_an_unreachable_coordinator_fails_after_the_timeout(cache_dir):
  p = _launch("train.py", TRAIN, processes=2, devices=4, cache=cache_dir, timeout_s=3)
  p[0].kill()  # process 0 never comes: process 1 waits distributed_initialization_timeout, then fails
  rc, _, e = _finish(p[1:], timeout=120)[0]
  assert rc == 2
  assert "distributed_coordinator_address" in _one_line_error(e)


@pytest.mark.slow
def test_a_failing_process_ends_every_process_at_once(cache_dir, tmp_path):
  # Process 1 alone cannot write its checkpoint shards (its base_output_directory is not a folder):
  # it fails at step 4's save, after collectives ran. Both must exit 1 from their own error (process
  # 0's next collective finds the peer gone), not by jax's heartbeat abort minutes later (134).
  results = _finish(_launch("train.py", TRAIN + [f"base_output_directory={tmp_path}"], processes=2, devices=4,
                            cache=cache_dir, per_process={1: ["base_output_directory=/dev/null/x"]}))
  (rc0, out0, err0), (rc1, _, err1) = results
  # process 1's own error is the lifecycle's one line about the checkpoint it could not write
  assert rc1 == 1 and "error: cannot write checkpoint step 4" in err1, err1[-2000:]
  # process 0 fails in the same save's collective, the peer gone: its own one-line error, exit 1
  assert rc0 == 1 and err0.strip().splitlines()[-1].startswith("error: "), err0[-2000:]
  assert 4 in _losses(out0)
