"""Prometheus metrics of one server: request outcomes, token counts, latencies, engine state.

Each app has its own registry, so several apps (tests) never share counters. Engine state
(queue lengths, KV pages, batches by phase, prefix cache lookups and hits) is read from
``engine.stats()`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "asyncinfer"

# Outcomes of a generation request: the engine's finish reasons, and what the server saw.
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "cancelled", "failed")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Engine gauges and batch counters, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = (("requests_waiting", "Requests queued for admission", stats.waiting),
                  ("requests_running", "Requests holding a slot", stats.running),
                  ("kv_pages_used", "KV cache pages in use", stats.kv_pages_used),
                  ("kv_pages_total", "KV cache pages in the pool", stats.kv_pages_total))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        batches = CounterMetricFamily(f"{PREFIX}_batches", "Batches run, by phase",
                                      labels=["phase"])
        batches.add_metric(["prefill"], stats.batches_prefill)
        batches.add_metric(["decode"], stats.batches_decode)
        batches.add_metric(["mixed"], stats.batches_mixed)
        yield batches
        counters = (
            ("prefix_cache_queries", "Prefix cache lookups (one per admitted request)",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache lookups that found cached tokens",
             stats.prefix_cache_hits),
            ("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
             stats.prefix_cache_query_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
             stats.prefix_cache_hit_tokens))
        rounds = (
            ("engine_rounds", "Rounds of the engine loop", stats.rounds),
            ("engine_round_host_seconds", "Seconds the engine loop's rounds spent on the "
             "host: scheduling, launching, processing, delivering",
             stats.round_host_seconds),
            ("engine_round_wait_seconds", "Seconds the engine loop's rounds spent awaiting "
             "the device", stats.round_wait_seconds),
            ("engine_device_busy_seconds", "Seconds the device spent on batches (CUDA; the "
             "rest of the wall time it idled)", stats.device_busy_seconds))
        for name, doc, value in counters + rounds:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServerMetrics:
    """The counters and histograms the handlers update, and the text ``/metrics`` serves."""

    def __init__(self, engine_stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "Generation requests, by outcome",
                                ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export every outcome from the first scrape
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated "
                                         "for finished requests", registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first "
                              "output token", buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean time between "
                              "output tokens after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def record_outcome(self, outcome: str) -> None:
        """Count one generation request as finished with ``outcome`` (one of OUTCOMES)."""
        self.requests.labels(outcome).inc()

    def observe(self, output: RequestOutput) -> None:
        """Token counts and latencies of a request the engine finished."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if m is None:
            return
        self.e2e.observe(max(m.finish_time - m.arrival_time, 0.0))
        if m.first_token_time is None:
            return
        self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
        if len(output.token_ids) > 1:
            self.tpot.observe(max(m.finish_time - m.first_token_time, 0.0)
                              / (len(output.token_ids) - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
