"""A run's life through the CLIs (subprocesses), in the situations a new user meets: runs chain
(dense warm-up -> sparse -> decode) through load_parameters_path, lr=1e6 never poisons a checkpoint,
a truncated or bit-flipped checkpoint (also one low mantissa bit, every value finite) falls back to
the one before, a resumed run keeps its model and data keys, a finished run says so, input and
environment errors are one line, --help, the console, eval, tensorboard after a resume, the profiler.

The subprocesses share compiled programs through JAX's persistent compilation cache (a folder per
module), so only the first run of each configuration compiles."""

import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.runtime import sharding
from MaxText.runtime.metrics import fmt_loss
from tests.conftest import FAST_COMPILE_FLAGS, REPO_ROOT, make_config, read_noise

DATA = os.path.join(REPO_ROOT, "tests", "data")
COMMON = ["mtp_num_layers=0", "log_period=1", "steps=4", "checkpoint_period=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax_cache")
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE_FLAGS,
          "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def cli(env, script, *args, timeout=600):
  return subprocess.run([sys.executable, f"MaxText/{script}", "configs/base.yml", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def one_error_line(r, code):
  """The process failed with `code` and said why in exactly one stderr line (no traceback)."""
  assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
  return lines[0]


def steps_logged(out: str) -> list[int]:
  return [int(m) for m in re.findall(r"^step (\d+)/\d+ \|", out, re.M)]


def tb_steps(run_dir, tag):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
  acc.Reload()
  return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def base_run(env, tmp_path_factory):
  """4 steps, checkpoints at 2 and 4, eval every 2 steps, step 2 profiled."""
  out = tmp_path_factory.mktemp("runs")
  r = cli(env, "train.py", *COMMON, f"base_output_directory={out}", "run_name=base", "eval_interval=2",
          "eval_steps=1", "profiler=xplane", "profiler_start_step=2", "profiler_steps=1")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return out, r.stdout


def copy_run(base_run, name):
  out, _ = base_run
  shutil.copytree(out / "base", out / name)
  return out, out / name


def data_files(step_dir):
  return [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs if os.sep + "d" + os.sep in
          os.path.join(d, f)]


def largest_data_file(step_dir):
  return max(data_files(step_dir), key=os.path.getsize)


# ---------------------------------------------------------------- console, eval, tensorboard, profiler (items 7-9)


def test_console_names_the_paths_each_checkpoint_and_sums_up(base_run):
  out, stdout = base_run
  run = out / "base"
  first = stdout.splitlines()[0]
  assert f"run {run}" in first and f"checkpoints {run}/checkpoints" in first
  assert f"tensorboard --logdir {run}/tensorboard" in first
  assert f"checkpoint step 2: {run}/checkpoints/2" in stdout and f"checkpoint step 4: {run}/checkpoints/4" in stdout
  last = stdout.strip().splitlines()[-1]
  assert re.match(r"done: steps 1-4 of 4 \(2,048 tokens\) in \dm\d\ds; final loss \S+ \| lm \S+ \| indexer \S+; "
                  r"eval loss \S+; "
                  rf"weights: load_parameters_path={run}/checkpoints$", last), last
  assert (run / "config.yml").is_file()


def test_small_losses_print_in_scientific_notation():
  assert fmt_loss(8.95e-05) == "8.95e-05" and fmt_loss(0.0) == "0.0000" and fmt_loss(1.83456) == "1.8346"


def test_eval_loss_on_the_console_and_in_tensorboard(base_run):
  out, stdout = base_run
  evals = re.findall(r"^eval step (\d+) \| loss (\S+)", stdout, re.M)
  assert [int(s) for s, _ in evals] == [2, 4]
  assert tb_steps(out / "base", "eval_loss") == [2, 4]
  assert float(evals[1][1]) < float(evals[0][1])  # the same held-out batch, after two more steps


def test_profiler_writes_a_trace_under_the_run_folder(base_run):
  out, stdout = base_run
  traces = [f for _, _, fs in os.walk(out / "base" / "profile") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces) and any(f.endswith(".trace.json.gz") for f in traces), traces
  assert "profile of steps 2-2:" in stdout


# ---------------------------------------------------------------- the run folder remembers its run (item 4)


def test_a_finished_run_says_so_and_how_to_continue(env, base_run):
  out, _ = base_run
  r = cli(env, "train.py", *COMMON, f"base_output_directory={out}", "run_name=base")
  assert r.returncode == 0, r.stderr
  assert "run 'base' is finished" in r.stdout and "raise steps (e.g. steps=8)" in r.stdout
  assert not steps_logged(r.stdout)


@pytest.mark.parametrize("change,named", [
    (["emb_dim=32"], "emb_dim=64 in the run, 32 now"),
    (["dataset_type=file", f"dataset_path={DATA}/corpus.txt", f"tokenizer_path={DATA}/tokenizer.model"],
     "dataset_type='synthetic' in the run, 'file' now"),
])
def test_resuming_with_other_model_or_data_keys_is_one_line(env, base_run, change, named):
  out, _ = base_run
  r = cli(env, "train.py", *COMMON, "steps=6", f"base_output_directory={out}", "run_name=base", *change)
  line = one_error_line(r, 2)
  assert named in line and "choose another run_name" in line


# ---------------------------------------------------------------- checkpoints are never poisoned (item 3)


def test_a_truncated_newest_checkpoint_falls_back_and_tensorboard_shows_each_step_once(env, base_run):
  out, run = copy_run(base_run, "truncated")
  with open(largest_data_file(run / "checkpoints" / "4"), "r+b") as f:
    f.truncate(1000)
  r = cli(env, "train.py", *COMMON, "steps=5", f"base_output_directory={out}", "run_name=truncated")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  unusable = [l for l in r.stdout.splitlines() if l.startswith("checkpoint step 4 is unusable")]
  assert len(unusable) == 1 and "cannot be read" in unusable[0], r.stdout
  assert not read_noise(r.stdout + r.stderr), r.stderr[-3000:]  # the abandoned reads ended quietly (issue 46)
  assert "resumed from checkpoint step 2" in r.stdout and steps_logged(r.stdout) == [3, 4, 5]
  assert (run / "checkpoints_unusable" / "4").is_dir()
  assert tb_steps(run, "loss") == [1, 2, 3, 4, 5]  # steps 3 and 4 of the first run purged


def test_decode_and_serve_take_the_weights_before_a_truncated_newest_step_in_one_line_and_quietly(
    base_run, said, lingering_reads):
  """model_state.load_or_create, as decode.py and serve.py call it (in-process), the race made certain."""
  _, run = copy_run(base_run, "weights")
  for path in data_files(run / "checkpoints" / "4"):  # every one: the largest may hold only optimizer state,
    with open(path, "r+b") as f:                      # which a parameter load never reads
      f.truncate(os.path.getsize(path) // 2)
  cfg = make_config(mtp_num_layers=0, load_parameters_path=str(run / "checkpoints"))
  said()
  lines = []
  _, _, _, source = model_state.load_or_create(cfg, sharding.create_mesh(cfg), report=lines.append)
  heard = said()
  assert len(lines) == 2 and lines[0].startswith(f"load_parameters_path: {run}/checkpoints/4/state is unusable: "
                                                 "it does not fit the configured model or cannot be read"), lines
  assert lines[1].endswith(f"params and buffers from {run}/checkpoints/2/state") and "RANDOM" not in source
  assert not read_noise(heard), heard[:3000]


def flip_lowest_mantissa_bit(step_dir):
  """Rewrites one float32 parameter of a saved state with its first value's lowest bit flipped (through
  tensorstore, into the same OCDBT database): every value stays finite, only the fingerprint sees it."""
  import tensorstore as ts
  base = {"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"}
  names = sorted(k.decode()[:-len("/.zarray")] for k in ts.KvStore.open(base).result().list().result()
                 if k.startswith(b"params.") and k.endswith(b"/.zarray"))
  for name in names:
    array = ts.open({"driver": "zarr", "kvstore": {**base, "path": name + "/"}}).result()
    if array.dtype == ts.float32 and array.size > 1:
      bits = array.read().result().view(np.uint32).copy()
      bits.reshape(-1)[0] ^= 1
      array.write(bits.view(np.float32)).result()
      return name
  raise AssertionError(f"no float32 parameter in {step_dir}")


def test_flipped_bits_are_caught_also_when_every_value_stays_finite_and_with_no_good_checkpoint_left_one_line(
    env, base_run):
  out, run = copy_run(base_run, "flipped")
  flip_lowest_mantissa_bit(run / "checkpoints" / "4")  # finite: only the fingerprint can refuse step 4
  path = largest_data_file(run / "checkpoints" / "2")  # bytes flipped on disk (non-finite values, or garbage)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2: len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 8])
  open(path, "wb").write(bytes(data))
  r = cli(env, "train.py", *COMMON, "steps=5", f"base_output_directory={out}", "run_name=flipped")
  line = one_error_line(r, 1)
  assert "no usable checkpoint" in line
  assert r.stdout.count("unusable: its contents do not match the fingerprint") == 2, r.stdout


def test_learning_rate_1e6_keeps_only_good_checkpoints_and_resuming_trains_on(env, tmp_path):
  args = ["mtp_num_layers=0", "log_period=1", "steps=6", "checkpoint_period=1", f"base_output_directory={tmp_path}",
          "run_name=lr"]
  r = cli(env, "train.py", *args, "learning_rate=1e6")
  line = one_error_line(r, 1)
  m = re.search(r"newest good checkpoint: step (\d+)", line)
  assert m and "loss nan" in line, line
  good = int(m.group(1))
  kept = sorted(int(d) for d in os.listdir(tmp_path / "lr" / "checkpoints"))
  assert kept[-1] == good
  r = cli(env, "train.py", *args, "learning_rate=3e-3")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert f"resumed from checkpoint step {good}" in r.stdout
  losses = [float(x) for x in re.findall(r"^step \d+/6 \| loss (\S+)", r.stdout, re.M)]
  assert len(losses) == 6 - good and np.all(np.isfinite(losses))


# ---------------------------------------------------------------- runs chain (item 1)


def test_the_sparse_stage_starts_from_the_warm_up_weights_and_decode_reads_them(env, tmp_path):
  common = ["log_period=1", f"base_output_directory={tmp_path}"]  # the tiny model's MTP layer: int keys in the tree
  r = cli(env, "train.py", *common, "run_name=warmup", "indexer_training_stage=dense_warmup", "steps=2")
  assert r.returncode == 0, r.stderr[-3000:]
  # Step 1 of the new run has lr 0 (warm-up from 0): its parameters are exactly those it started from.
  r = cli(env, "train.py", *common, "run_name=sparse", "indexer_training_stage=sparse", "steps=1",
          f"load_parameters_path={tmp_path}/warmup/checkpoints")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "step 1/1 |" in r.stdout and "lr 0.00e+00" in r.stdout  # a new run: step 0, fresh optimizer

  def params(step_dir):
    return ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"))["params"]

  def indexer(tree):  # {'a/0/indexer/b': array}: a tree read from disk spells the int key 0 as '0'
    named = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(x)
             for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    return {k: v for k, v in named.items() if "/indexer/" in k}

  warm, sparse = indexer(params(tmp_path / "warmup/checkpoints/2")), indexer(params(tmp_path / "sparse/checkpoints/1"))
  cfg = make_config()
  fresh = indexer(model_state.create(cfg, sharding.create_mesh(cfg))[1])
  assert warm.keys() == sparse.keys() == fresh.keys() and warm
  for k in warm:
    np.testing.assert_array_equal(sparse[k], warm[k], err_msg=k)
  assert any(not np.array_equal(warm[k], fresh[k]) for k in warm)  # the warm-up trained them: not a random start

  # Every form of the path gives the same weights; decode takes them too.
  mesh = sharding.create_mesh(cfg)
  got = [model_state.load_parameters(str(p), cfg, mesh, report=lambda _: None)[1] for p in
         (tmp_path / "warmup", tmp_path / "warmup/checkpoints", tmp_path / "warmup/checkpoints/2",
          tmp_path / "warmup/checkpoints/2/state")]
  for g in got[1:]:
    jax.tree.map(np.testing.assert_array_equal, g, got[0])
  assert indexer(got[0]).keys() == warm.keys()
  r = cli(env, "decode.py", "prompt=1,2,3", "max_prefill_length=8", "max_target_length=12",
          f"load_parameters_path={tmp_path}/warmup/checkpoints/2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "RANDOM" not in r.stdout and f"params and buffers from {tmp_path}/warmup/checkpoints/2/state" in r.stderr


# ---------------------------------------------------------------- one line per input or environment error (items 5, 6)


def _write(path, data: bytes):
  path.write_bytes(data)
  return str(path)


def _error_cases(tmp_path):
  blocker = _write(tmp_path / "a_file", b"x")
  full = tmp_path / "full"
  (full / "run").mkdir(parents=True)
  os.symlink("/dev/full", full / "run" / "config.yml")  # every write there: "No space left on device"
  file_run = ["dataset_type=file", f"tokenizer_path={DATA}/tokenizer.model"]
  corpus = f"dataset_path={DATA}/corpus.txt"
  return [
      (file_run + [f"dataset_path={tmp_path}/missing.txt"], 2, "does not exist"),
      (file_run + [f"dataset_path={_write(tmp_path / 'empty.txt', b'')}"], 2, "holds no documents"),
      (file_run + [f"dataset_path={_write(tmp_path / 'binary.txt', bytes(range(256)))}"], 2, "not valid UTF-8"),
      (file_run + [f"dataset_path={_write(tmp_path / 'bad.jsonl', b'{oops')}"], 2, "not valid JSON"),
      (["dataset_type=file", corpus, f"tokenizer_path={tmp_path}/missing.model"], 2, "tokenizer_path="),
      (["dataset_type=file", corpus, f"tokenizer_path={_write(tmp_path / 'bad.model', b'garbage')}"], 2,
       "not a readable sentencepiece model"),
      (file_run + [corpus, "vocab_size=100"], 2, "set vocab_size >="),
      (["dataset_type=grain", f"grain_train_files={tmp_path}/none-*.arrayrecord"], 2, "matches no file"),
      ([f"base_output_directory={blocker}/outputs"], 1, "Not a directory"),
      ([f"base_output_directory={full}"], 1, "No space left on device"),
  ]


def test_input_and_environment_errors_are_one_line(tmp_path, capsys):
  """In-process through train.main (each fails before any compilation), the way the CLI runs it."""
  for args, code, message in _error_cases(tmp_path):
    with pytest.raises(SystemExit) as exit_:
      train.main(["train.py", "configs/base.yml", "run_name=run", f"base_output_directory={tmp_path}/out", *args])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert exit_.value.code == code and len(lines) == 1 and message in lines[0], (args, exit_.value.code, err)


def test_a_read_only_output_folder_is_one_line_through_the_cli(env, tmp_path):
  (tmp_path / "a_file").write_text("x")
  r = cli(env, "train.py", f"base_output_directory={tmp_path}/a_file/outputs")
  assert "Not a directory" in one_error_line(r, 1) and "Traceback" not in r.stderr


def test_help_tells_usage_the_key_value_convention_and_where_keys_are_documented(env, capsys):
  r = subprocess.run([sys.executable, "MaxText/train.py", "--help"], cwd=REPO_ROOT, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0 and "usage: python MaxText/train.py <config.yml> [key=value ...]" in r.stdout, r.stderr
  assert "configs/base.yml" in r.stdout and "not found" not in r.stdout + r.stderr
  from MaxText import decode
  from MaxText.config import pyconfig
  for main, argv in ((decode.main, ["MaxText/decode.py", "-h"]),
                     (lambda a: pyconfig.initialize_or_exit(a, pyconfig.__doc__), ["python -m MaxText.config", "--help"])):
    with pytest.raises(SystemExit) as exit_:
      main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "key=value" in out and pyconfig.BASE_YML in out, out


def test_a_checkpoint_of_another_model_is_named_by_its_first_differing_parameter(base_run):
  """What a run folder without config.yml (or a load_parameters_path of another model) reports."""
  from MaxText.checkpoint import orbax_state
  out, _ = base_run
  _, abs_params, abs_buffers = model_state.abstract_model(make_config(mtp_num_layers=0, emb_dim=32))
  target = {"params": abs_params.to_pure_dict(), "buffers": abs_buffers.to_pure_dict()}
  why = orbax_state.model_mismatch(str(out / "base" / "checkpoints" / "2" / "state"), target)
  assert why is not None and re.search(r"params/\S+ is \(.*64.*\) in the checkpoint but \(.*32.*\) in this config",
                                       why), why
  _, abs_params, abs_buffers = model_state.abstract_model(make_config(mtp_num_layers=0))
  same = {"params": abs_params.to_pure_dict(), "buffers": abs_buffers.to_pure_dict()}
  assert orbax_state.model_mismatch(str(out / "base" / "checkpoints" / "2" / "state"), same) is None


def test_eval_data_is_held_out_synthetic_rows_or_the_eval_files(tmp_path):
  from MaxText.data import input_pipeline
  cfg = make_config(eval_interval=1)
  train_rows = next(input_pipeline.create_data_iterator(cfg, process_index=0, process_count=1))["inputs"]
  eval_it = input_pipeline.create_eval_iterator(cfg, process_index=0, process_count=1)
  assert not np.array_equal(eval_it.source[0]["inputs"], train_rows)
  np.testing.assert_array_equal(eval_it.source[0]["inputs"], eval_it.source[0]["inputs"])  # the same every time
  held_out = tmp_path / "eval.txt"
  held_out.write_text("zebra quartz\n\nvolcano jigsaw\n")
  cfg = make_config(eval_interval=1, dataset_type="file", dataset_path=f"{DATA}/corpus.txt",
                    tokenizer_path=f"{DATA}/tokenizer.model", eval_dataset_path=str(held_out))
  eval_it = input_pipeline.create_eval_iterator(cfg, process_index=0, process_count=1)
  assert eval_it.report.files == [str(held_out)] and eval_it.report.documents == 2
  with pytest.raises(Exception, match="needs eval_dataset_path"):
    make_config(eval_interval=1, dataset_type="file", dataset_path=f"{DATA}/corpus.txt")
