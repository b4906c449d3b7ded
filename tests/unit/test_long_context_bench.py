"""benchmarks/long_context.py: each length's rung picked by the first path's fit, every path timed at that rung
side by side, what does not fit or runs out of budget stated; the --quick run end to end on the CPU."""

import json

import pytest

from benchmarks import long_context as bench


def _fake_train_step(peaks: dict, calls: list):
  """A train_step stand-in: fits where peaks[(length, rung's first key=value, path)] <= 15.75 GiB."""

  def step(overrides, steps, trace_dir, compile_only):
    path = next(p for p, o in bench.PATHS.items() if all(overrides.get(k) == v for k, v in o.items()))
    rung = "layers=1" if overrides.get("num_decoder_layers") == 1 else "full"
    calls.append((overrides["max_target_length"], rung, path))
    peak = peaks[(overrides["max_target_length"], rung, path)]
    out = dict(peak_gib=peak, limit_gib=15.75, compile_s=1.0, fits=peak <= 15.75)
    if out["fits"] and not compile_only:
      out.update(step_ms=100.0 if path == "gather" else 400.0, model_mfu=0.5, loss=1.0)
    return out

  return step


def test_the_first_path_picks_the_rung_and_the_others_run_there_even_where_they_do_not_fit(monkeypatch):
  peaks = {(8192, "full", "gather"): 12.0, (8192, "full", "mask"): 14.0,
           (32768, "full", "gather"): 20.0, (32768, "layers=1", "gather"): 11.0, (32768, "layers=1", "mask"): 30.0}
  calls = []
  monkeypatch.setattr(bench.device_check, "train_step", _fake_train_step(peaks, calls))
  ladder = [["remat_policy=full"], ["remat_policy=full", "num_decoder_layers=1", "first_num_dense_layers=1"]]
  rows = bench.measure("deepseek3.2-v5e", [8192, 32768], ["gather", "mask"], ladder, 3, False, {}, float("inf"))
  assert calls == [(8192, "full", "gather"), (8192, "full", "mask"),
                   (32768, "full", "gather"), (32768, "layers=1", "gather"), (32768, "layers=1", "mask")]
  by = {(r["length"], r["path"], r["rung"]): r for r in rows}
  assert not by[(32768, "gather", "remat_policy=full")]["fits"]  # the rung that did not fit stays a row
  assert not by[(32768, "mask", " ".join(ladder[1]))]["fits"]  # mask stated at gather's rung, not moved on
  assert bench.ratios(rows) == {"8192:mask/gather": 4.0}
  assert "does not fit: 30.0 GiB > 15.75 GiB" in bench.fmt(by[(32768, "mask", " ".join(ladder[1]))])


def test_a_length_no_rung_fits_and_a_run_past_the_budget_are_stated_not_run(monkeypatch):
  calls = []
  monkeypatch.setattr(bench.device_check, "train_step", _fake_train_step({(65536, "full", "gather"): 40.0}, calls))
  rows = bench.measure("m", [65536], ["gather", "mask"], [["remat_policy=full"]], 3, False, {}, float("inf"))
  assert [r.get("skipped") for r in rows] == [None, "no rung fits gather"]
  rows = bench.measure("m", [65536], ["gather", "mask"], [["remat_policy=full"]], 3, False, {}, 0.0)
  assert calls == [(65536, "full", "gather")] and "out of budget" in rows[0]["skipped"]


def test_a_path_that_fails_is_a_row_with_its_error_and_the_next_still_runs(monkeypatch):
  calls = []
  fake = _fake_train_step({(8192, "full", "gather"): 10.0, (16384, "full", "gather"): 10.0}, calls)

  def step(overrides, *a):
    if overrides.get("use_indexer") is False:
      raise RuntimeError("Mosaic failed to compile\nmore lines")
    return fake(overrides, *a)

  monkeypatch.setattr(bench.device_check, "train_step", step)
  rows = bench.measure("m", [8192, 16384], ["gather", "mask"], [["remat_policy=full"]], 3, False, {}, float("inf"))
  assert rows[1]["failed"] == "RuntimeError: Mosaic failed to compile"
  assert bench.fmt(rows[1]) == "failed: RuntimeError: Mosaic failed to compile"
  assert [r["length"] for r in rows] == [8192, 8192, 16384, 16384] and "step_ms" in rows[2]


def test_bad_paths_and_rungs_are_one_usage_line():
  with pytest.raises(SystemExit) as e:
    bench.main(["--paths", "gather,dense"])
  assert e.value.code == 2
  with pytest.raises(SystemExit):
    bench.main(["--set", "remat_policy"])


@pytest.mark.slow  # two compiles: ~10 s of CPU
def test_quick_run_times_both_paths_side_by_side_on_the_cpu(capsys):
  bench.main(["--quick", "--lengths", "256", "--steps", "1", "--set", "num_decoder_layers=1",
              "first_num_dense_layers=1"])
  out = capsys.readouterr().out
  got = json.loads(out.strip().splitlines()[-1])
  gather, mask = (next(r for r in got["rows"] if r["path"] == p) for p in ("gather", "mask"))
  assert gather["fits"] and mask["fits"] and gather["rung"] == mask["rung"]
  assert gather["step_ms"] > 0 and mask["step_ms"] > 0 and gather["tokens"] == 256
  assert gather["params"] > mask["params"]  # the dense step has no indexer
  assert set(got["ratios"]) == {"256:mask/gather"} and "256 gather" in out
