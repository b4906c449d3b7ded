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
