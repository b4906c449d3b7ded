"""GET /metrics: Prometheus text (prometheus_client), one registry per server.

Gauges come from the engine's stats() as the engine thread last published them (running and
waiting requests, pages used / total / cached, the prefix-cache hit rate, and the speculative
acceptance rate when the engine reports `spec_acceptance`); counters and histograms are observed
per request as it ends (prompt and generated tokens, time to first token, time per output token,
requests by finish reason).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# engine stats() key -> (metric name, help)
_GAUGES = {
    "running": ("maxtext_requests_running", "requests in the running batch"),
    "waiting": ("maxtext_requests_waiting", "requests waiting for a sequence slot or pages"),
    "pages_used": ("maxtext_pages_used", "cache pages held by requests (not counting free cached pages)"),
    "pages_total": ("maxtext_pages_total", "cache pages per pool (serve_num_pages)"),
    "pages_cached": ("maxtext_pages_cached", "free pages that hold a cached prompt prefix"),
    "prefix_hit_rate": ("maxtext_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / looked up"),
    "spec_acceptance": ("maxtext_spec_decode_acceptance_rate", "speculative tokens accepted / proposed"),
    "step_programs": ("maxtext_step_programs", "compiled step programs (one per shape and variant, compiled on first "
                      "use): a count that keeps growing under steady traffic is a compile per request"),
}
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
  def __init__(self):
    self.registry = r = CollectorRegistry()
    self._gauges: dict[str, Gauge] = {}
    self.ready = Gauge("maxtext_engine_ready", "1 once the engine compiled its programs, else 0", registry=r)
    self.prompt_tokens = Counter("maxtext_prompt_tokens", "prompt tokens of finished requests", registry=r)
    self.generation_tokens = Counter("maxtext_generation_tokens", "tokens generated", registry=r)
    self.requests = Counter("maxtext_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
    self.ttft = Histogram("maxtext_time_to_first_token_seconds", "request arrival to its first token",
                          buckets=_TTFT_BUCKETS, registry=r)
    self.tpot = Histogram("maxtext_time_per_output_token_seconds", "mean time between a request's tokens after "
                          "the first", buckets=_TPOT_BUCKETS, registry=r)

  def observe(self, *, prompt_tokens: int, generated: int, finish_reason: str, arrival: float,
              first_token: float | None, last_token: float | None) -> None:
    """One finished request (times from time.perf_counter)."""
    self.prompt_tokens.inc(prompt_tokens)
    self.generation_tokens.inc(generated)
    self.requests.labels(finish_reason).inc()
    if first_token is not None:
      self.ttft.observe(first_token - arrival)
      if generated > 1 and last_token is not None:
        self.tpot.observe((last_token - first_token) / (generated - 1))

  def render(self, stats: dict, ready: bool) -> bytes:
    self.ready.set(1 if ready else 0)
    for key, value in stats.items():
      if key not in _GAUGES or value is None:
        continue
      if key not in self._gauges:  # spec_acceptance appears only with an engine that reports it
        name, help_text = _GAUGES[key]
        self._gauges[key] = Gauge(name, help_text, registry=self.registry)
      self._gauges[key].set(float(value))
    return generate_latest(self.registry)
