"""tools/device/device_check.py without running it: every config it would train is a valid config,
and its table reads a canned result (the whole script runs on the CPU: docs/accelerators.md)."""

import importlib.util
import os

import pytest

from MaxText.config import pyconfig

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "device", "device_check.py")
_spec = importlib.util.spec_from_file_location("device_check", _PATH)
dc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dc)


@pytest.mark.parametrize("kind", ["cpu", "accelerator"])
def test_every_train_config_of_the_check_is_valid(kind):
  sizes = dc.SIZES[kind]
  for overrides in [sizes["tiny"]["overrides"]] + [o for _, o in sizes["large"]]:
    cfg = pyconfig.initialize(["device_check", "base.yml"], num_devices=1, ici_data_parallelism=1, scan_layers=False,
                              enable_checkpointing=False, enable_tensorboard=False, **overrides)
    assert cfg.global_batch_size * cfg.max_target_length > 0
  assert set(dc.LIMITS[kind]) == set(dc.SECTIONS)


def test_table_rows_read_a_result_of_each_section():
  mfu = dict(status="ok", seconds=1, config="tiny", params=4e5, tokens=512, step_ms=80.0, tflops_per_s=0.02,
             mfu=0.16, model_mfu=0.08, peak_tflops=0.1, peak_source="table (NVIDIA H200)", peak_gib=0.04, fits=True)
  assert "MFU 16.00% (model FLOPs 8.00%)" in dc._fmt("mfu_tiny", mfu)
  assert "nothing in the ladder fits: a: 9 GiB > 1 GiB" in dc._fmt("mfu_large", dict(
      status="ok", seconds=1, fits=False, tried_first=["a: 9 GiB > 1 GiB"]))
  assert dc._fmt("tests", dict(status="failures", seconds=1, counts={"passed": 3, "failed": 1},
                               failed=["t.py::x"])) == "3 passed, 1 failed; failed: t.py::x"
  assert dc._fmt("decode", dict(status="ok", seconds=1, rows=[dict(context=4096, sparse_ms=2.0, dense_ms=5.0)])) \
      == "4096 context: sparse 2.0 ms, dense 5.0 ms (2.5x)"
  assert dc._fmt("selection", dict(status="timeout (9 s)", seconds=9, error="boom")) == "boom"


def _run(lines, rc=0, end=None):
  lines = [(float(t), text) for t, text in lines]
  return dict(rc=rc, seconds=end if end is not None else lines[-1][0], lines=lines,
              exit_after_last_s=round((end or lines[-1][0]) - lines[-1][0], 1))


TRAIN = [(1, "run outputs/readme: ..."), (5, "step 1/150 | loss 6.3000 | lm 6.2000 | indexer 0.1000 | 10 tok/s"),
         (40, "step 150/150 | loss 1.9000 | lm 1.8000 | indexer 0.0200 | 10 tok/s"), (41, "done: steps 1-150 ...")]


@pytest.mark.parametrize("end,rc,lines,why", [
    (41.0, 0, TRAIN, ""),
    (51.0, 0, TRAIN, ""),                                  # exactly EXIT_S after done: still in time
    (51.2, 0, TRAIN, "exited 10.2 s after its done: line"),
    (41.0, 1, TRAIN, "exit 1"),
    (41.0, None, TRAIN, "exit None"),                      # killed at the section's limit
    (41.0, 0, TRAIN[:1] + TRAIN[2:], "the loss did not fall"),  # one step line: nothing to compare
    (41.0, 0, TRAIN[:1] + [TRAIN[2], TRAIN[1], TRAIN[3]], "the loss did not fall"),
    (41.0, 0, TRAIN[:3], "no done: line"),
])
def test_a_readme_train_run_passes_only_with_a_falling_loss_and_a_prompt_exit(end, rc, lines, why):
  r = dc.readme_check._train_figures(_run(lines, rc, end), "train")
  assert r["ok"] == (why == "") and r["why"].startswith(why), r
  if r["ok"]:
    assert (r["first_lm"], r["last_lm"], r["steps"], r["done_s"]) == (6.2, 1.8, 150, 41.0)
    assert "150 steps, lm 6.2 -> 1.8 (first -> last quarter), done at 41.0 s" in dc._fmt("readme_train", dict(r, status="ok", seconds=end))


@pytest.mark.parametrize("out,why", [
    (dict(ready_s=20.0, answers=[dict(path="/v1/completions", status=200, seconds=0.5, body={})], rc=0,
          exit_after_sigterm_s=2.0), ""),
    (dict(ready_s=20.0, answers=[], rc=0, exit_after_sigterm_s=10.0), ""),
    (dict(ready_s=20.0, answers=[], rc=0, exit_after_sigterm_s=10.5), "alive 10.5 s after SIGTERM"),
    (dict(ready_s=20.0, answers=[], rc=None, exit_after_sigterm_s=None), "alive 60 s after SIGTERM"),
    (dict(ready_s=20.0, answers=[], rc=1, exit_after_sigterm_s=1.0), "exit 1 after SIGTERM"),
    (dict(ready_s=None, answers=[], rc=2, exit_after_sigterm_s=0.1, log_tail="error: x"), "no /health 200: error: x"),
    (dict(ready_s=5.0, answers=[dict(path="/v1/chat/completions", status=500, seconds=0.1, body={"e": 1})], rc=0,
          exit_after_sigterm_s=1.0), "/v1/chat/completions answered 500"),
])
def test_a_readme_server_passes_only_ready_answering_and_ending_after_sigterm(out, why):
  got = dc.readme_check._serve_verdict(out)
  assert got.startswith(why) and (got == "") == (why == ""), got


def test_a_noisy_loss_is_judged_by_its_first_and_last_quarter():
  """One sequence a batch: the v5e file's lm went 0.94 at step 50 and 14.5 at 140 (TPU v5e); the means of a
  quarter of the logged steps decide, not two single steps."""
  lm = [11.0, 12.0, 13.0, 0.9, 10.0, 8.0, 6.0, 10.0, 5.0, 7.0, 6.0, 9.0, 3.0, 2.0, 1.0, 20.0]  # last step: a hard batch
  lines = [(i + 1, f"step {10 * (i + 1)}/160 | loss {v} | lm {v} | 1 tok/s") for i, v in enumerate(lm)]
  r = dc.readme_check._train_figures(_run(lines + [(20, "done: ...")], 0, 21.0), "v5e")
  assert r["ok"] and (r["first_lm"], r["last_lm"]) == (9.225, 6.5), r
