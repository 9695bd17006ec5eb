"""Prometheus metrics for `/metrics`, under vLLM's names (a dashboard built for vLLM reads them unchanged).

Counters: `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total` (label
`finished_reason`: stop, length, abort), `vllm:num_preemptions_total`. Histograms (seconds):
`vllm:time_to_first_token_seconds` (from the HTTP request's arrival), `vllm:time_per_output_token_seconds` (each
gap between two tokens of a request; also under vLLM's newer name `vllm:inter_token_latency_seconds`) and
`vllm:e2e_request_latency_seconds`. Gauges, read when scraped: `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (fraction of KV pages in use, 0..1). Every series has the
`model_name` label. Each app has its own registry (several servers can live in one process, as in the tests).
"""

from __future__ import annotations

from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class Metrics:
    """The app's metrics over an `EngineLoop` (its `stats()` feeds the gauges)."""

    def __init__(self, loop: Any, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.", label,
                                         registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                label + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s).", label,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self._tpot = Histogram("vllm:time_per_output_token_seconds", "Time between two output tokens (s).", label,
                               buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output tokens (s).", label,
                              buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (s).", label,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.model_name = model_name
        stat = lambda key: (lambda: loop.stats()[key])
        Gauge("vllm:num_requests_running", "Requests in the running batch.", label,
              registry=r).labels(model_name).set_function(stat("running"))
        Gauge("vllm:num_requests_waiting", "Requests waiting to run.", label,
              registry=r).labels(model_name).set_function(stat("waiting"))
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (fraction of pages in use, 1 = full).", label,
              registry=r).labels(model_name).set_function(
            lambda: 1 - (s := loop.stats())["free_pages"] / max(s["total_pages"], 1))
        preempt = Counter("vllm:num_preemptions", "Preemptions (recompute).", label, registry=r).labels(model_name)
        self._preempt, self._loop = preempt, loop

    def token_gap(self, seconds: float) -> None:
        """One gap between two output tokens of a request (both of vLLM's names for the series)."""
        self._tpot.observe(seconds)
        self._itl.observe(seconds)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition."""
        from prometheus_client import generate_latest

        seen = self._loop.stats()["preemptions"]
        counted = self._preempt._value.get()
        if seen > counted:
            self._preempt.inc(seen - counted)
        return generate_latest(self.registry)
