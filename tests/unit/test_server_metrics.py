"""The server's Prometheus metrics (MaxText/server/metrics.py): gauges from the engine's stats(), the
speculative acceptance rate only once the engine reports it, TTFT and TPOT per finished request."""

import re

from MaxText.server.metrics import ServerMetrics


def _values(text: bytes) -> dict[str, float]:
  return {k: float(v) for k, v in re.findall(r"^(\S+) (\S+)$", text.decode(), re.M)}


def test_gauges_follow_stats_and_spec_acceptance_appears_when_reported():
  m = ServerMetrics()
  stats = {"running": 3, "waiting": 1, "pages_used": 7, "pages_total": 32, "pages_cached": 2, "prefix_hit_rate": 0.5,
           "steps": 10, "step_programs": 18}
  v = _values(m.render(stats, ready=True))
  assert v["maxtext_requests_running"] == 3 and v["maxtext_requests_waiting"] == 1
  assert v["maxtext_pages_used"] == 7 and v["maxtext_pages_total"] == 32 and v["maxtext_prefix_cache_hit_rate"] == 0.5
  assert v["maxtext_engine_ready"] == 1 and not any("spec" in k for k in v) and v["maxtext_step_programs"] == 18
  v = _values(m.render({**stats, "running": 0, "spec_acceptance": 0.75}, ready=True))
  assert v["maxtext_spec_decode_acceptance_rate"] == 0.75 and v["maxtext_requests_running"] == 0


def test_a_finished_request_counts_its_tokens_and_times():
  m = ServerMetrics()
  m.observe(prompt_tokens=5, generated=11, finish_reason="length", arrival=1.0, first_token=1.25, last_token=2.25)
  m.observe(prompt_tokens=3, generated=0, finish_reason="abort", arrival=1.0, first_token=None, last_token=None)
  v = _values(m.render({}, ready=False))
  assert v["maxtext_prompt_tokens_total"] == 8 and v["maxtext_generation_tokens_total"] == 11
  assert v['maxtext_requests_total{finish_reason="abort"}'] == 1 and v["maxtext_engine_ready"] == 0
  assert v["maxtext_time_to_first_token_seconds_sum"] == 0.25 and v["maxtext_time_to_first_token_seconds_count"] == 1
  assert v["maxtext_time_per_output_token_seconds_sum"] == 0.1  # (2.25 - 1.25) / 10
