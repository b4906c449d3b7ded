"""benchmarks/soak.py's bookkeeping, without a server: which statuses count against the server, what
/metrics parses to, the per-minute series, each check at its boundary, and the server config the soak reads."""

import os

import pytest

from benchmarks.soak import (
  Tally,
  _by_minute,
  _metrics,
  growth_without_compiles,
  server_args,
  server_config,
  soak_checks,
)

METRICS = """# HELP maxtext_requests_total finished requests by finish reason
maxtext_requests_total{finish_reason="length"} 7.0
maxtext_requests_total{finish_reason="abort"} 2.0
maxtext_pages_used 0.0
maxtext_pages_total 64.0
maxtext_pages_cached 5.0
maxtext_requests_running 0.0
maxtext_requests_waiting 1.0
maxtext_step_programs 18.0
"""


def test_metrics_sums_every_finish_reason_and_reads_the_gauges():
  m = _metrics(METRICS)
  assert m["finished"] == 9.0 and m["finished_length"] == 7.0 and m["finished_abort"] == 2.0
  assert (m["pages_used"], m["pages_total"], m["pages_cached"]) == (0.0, 64.0, 5.0)
  assert (m["requests_running"], m["requests_waiting"], m["step_programs"]) == (0.0, 1.0, 18.0)
  assert _metrics("")["step_programs"] is None and _metrics("")["finished"] == 0.0


def test_a_429_is_expected_of_any_kind_a_400_only_of_a_malformed_body_and_a_408_is_accepted():
  t = Tally()
  t.add("burst", 429, "full")
  t.add("plain", 429, "full")        # a burst filled the queue just before
  t.add("malformed", 400, "bad")
  t.add("plain", 200)
  assert not t.errors and t.accepted == 1
  t.add("plain", 400, "why")         # a well-formed request refused: the server's fault
  t.add("malformed", 429, "full")    # a malformed body must be refused for what it is, not queued
  t.add("json", 408, "ran past serve_request_timeout")
  t.add("stream", 0, "ReadTimeout: ")
  assert set(t.errors) == {"plain 400: why", "malformed 429: full", "json 408: ran past serve_request_timeout",
                           "stream 0: ReadTimeout: "}
  assert t.accepted == 2  # the 200 and the 408 (taken, then ended)
  assert t.status[0] == 1 and sum(t.kinds.values()) == 8
  assert t.server_errors() == 1
  t.add("plain", 503, "busy")
  t.add("plain", 499, "client closed")
  assert t.server_errors() == 2


def test_by_minute_keeps_each_minutes_last_sample():
  samples = [(0.1, 100.0, 4), (0.9, 110.04, 6), (1.2, 120.0, None), (3.5, 130.0, 7)]
  assert _by_minute(samples) == {"rss_mib": [110.0, 120.0, 130.0], "step_programs": [6, None, 7]}
  assert _by_minute([]) == {"rss_mib": [], "step_programs": []}


def _result(**over):
  r = {"status_5xx": 0, "pages_leaked": 0, "pages_cached": 64, "pages_total": 64, "rss_growth": 0.10,
       "metrics_finished": 1}
  r.update(over)
  return r


def _tally():
  t = Tally()
  for kind, status in (("plain", 200), ("burst", 429), ("malformed", 400)):
    t.add(kind, status, "")
  return t


def test_each_check_passes_at_its_bound_and_fails_just_past_it():
  assert all(soak_checks(_result(), _tally()).values())
  failing = {
      "no 5xx or hung request": _result(status_5xx=1),
      "every page back in the pool": _result(pages_leaked=1),
      "resident memory within 10% of warm-up (compiles aside)": _result(rss_growth=0.1001),
      "/metrics counts every accepted request": _result(metrics_finished=2),
  }
  for name, result in failing.items():
    checks = soak_checks(result, _tally())
    assert [k for k, ok in checks.items() if not ok] == [name]
  assert not soak_checks(_result(pages_cached=65), _tally())["every page back in the pool"]
  no_429 = Tally()
  no_429.add("plain", 200)
  no_429.add("malformed", 400)
  assert [k for k, ok in soak_checks(_result(), no_429).items() if not ok] == [
      "429s seen (bursts past serve_max_waiting)"]
  unrefused = Tally()
  for kind, status in (("plain", 200), ("burst", 429), ("malformed", 200)):
    unrefused.add(kind, status, "")
  assert not soak_checks(_result(metrics_finished=2), unrefused)["400s for the malformed bodies"]


def test_memory_growth_counts_only_the_intervals_without_a_compile():
  # minute, rss, programs: +50 at a compile (18 -> 19) is not counted, nor +30 in the interval before it (the
  # compile in flight); +10 and -5 between equal counts are
  samples = [(0, 90.0, 17), (1, 100.0, 18), (2, 110.0, 18), (3, 140.0, 18), (4, 190.0, 19), (5, 185.0, 19),
             (6, 185.0, 19), (7, 170.0, None), (8, 171.0, 19)]  # a missed count: the pairs beside it skipped
  assert growth_without_compiles(samples, 1) == (10.0 - 5.0) / 100.0
  assert growth_without_compiles(samples, 0) == (10.0 - 5.0) / 90.0  # 90 -> 100 came with a compile
  leak = [(m, 100.0 + 2 * m, 18) for m in range(10)]  # a steady leak with no compile: all of it counts
  assert growth_without_compiles(leak, 0) == 18.0 / 100.0
  assert growth_without_compiles(leak, 9) == 0.0 and growth_without_compiles([], 0) == 0.0


def test_the_soak_reads_serve_keep_alive_as_the_server_resolves_it(monkeypatch):
  from MaxText.config import pyconfig
  from MaxText.config.types import ConfigError

  def served(overrides):  # what `python -m MaxText.serve` resolves from the soak's arguments (one device)
    return pyconfig.initialize(["serve", *server_args(8000, 4, 4, overrides)], num_devices=1).serve_keep_alive

  def soaked(overrides):
    return server_config(server_args(8000, 4, 4, overrides)).serve_keep_alive

  assert soaked([]) == served([]) == pyconfig._load_yaml(pyconfig.BASE_YML)["serve_keep_alive"]
  assert soaked(["serve_keep_alive=7.5"]) == served(["serve_keep_alive=7.5"]) == 7.5
  assert soaked(["serve_keep_alive=12"]) == 12.0
  assert soaked(["serve_keep_alive=3", "ici_data_parallelism=2"]) == 3.0  # a mesh for more devices than here
  with pytest.raises(ConfigError, match="serve_keep_alive"):
    soaked(["serve_keep_alive=0"])
  # base.yml's default, whatever it is, not a copy of it: move the default and the soak follows
  load = pyconfig._load_yaml
  monkeypatch.setattr(pyconfig, "_load_yaml", lambda p: {**load(p), "serve_keep_alive": 9.0}
                      if os.path.samefile(p, pyconfig.BASE_YML) else load(p))
  assert soaked([]) == served([]) == 9.0
