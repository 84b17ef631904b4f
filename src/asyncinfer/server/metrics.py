"""Prometheus metrics of one server: request outcomes, token counts, latencies, engine state.

Each app has its own registry, so several apps (tests) never share counters. Engine state
(queue lengths, KV pages, batches by phase, prefix cache lookups and hits) is read from
``engine.stats()`` at scrape time.

What has a vLLM metric of the same meaning is exported under vLLM's name too (``vllm:``,
labelled ``model_name``), since gateways scrape those names from servers they do not know
(``VLLM_NAMES``; README's metrics section lists them).
"""

from __future__ import annotations

import time
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


VLLM = "vllm"
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
              "vllm:cache_config_info", "vllm:lora_requests_info",
              "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
              "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds")
"""Our metrics also exported under vLLM's names (counters with Prometheus' ``_total``)."""

# vLLM counts requests that finished, by the reason it reports.
_VLLM_REASONS = ("stop", "length", "abort")


class _EngineCollector(Collector):
    """Engine gauges and batch counters, read when Prometheus scrapes; under vLLM's names
    too, with ``model_name`` and the page size as vLLM's block size."""

    def __init__(self, stats: Callable[[], Any], model_name: str, page_size: int) -> None:
        self._stats = stats
        self._model, self._page_size = model_name, page_size

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from self._vllm(stats)
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
             stats.prefix_cache_hit_tokens),
            ("kv_event_batches", "KV-cache event batches published (kv_events)",
             stats.kv_event_batches),
            ("kv_event_batches_dropped", "KV-cache event batches dropped: the publisher's "
             "queue was full", stats.kv_event_batches_dropped))
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

    def _vllm(self, stats: Any) -> Iterator[Metric]:
        model = [self._model]
        usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        for name, doc, value in (
                ("num_requests_running", "Requests holding a slot", stats.running),
                ("num_requests_waiting", "Requests queued for admission", stats.waiting),
                ("kv_cache_usage_perc", "Share of KV cache pages in use (1 = all), cached "
                 "pages no request holds not counted", usage),
                ("gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its older name",
                 usage)):
            gauge = GaugeMetricFamily(f"{VLLM}:{name}", doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        info = GaugeMetricFamily(f"{VLLM}:cache_config_info", "The KV cache's settings "
                                 "(block_size: tokens per page)",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([*model, str(self._page_size), str(stats.kv_pages_total)], 1.0)
        yield info
        # No LoRA adapters: none may load, none run or wait (the value: when, as vLLM's).
        lora = GaugeMetricFamily(f"{VLLM}:lora_requests_info", "LoRA adapters: none here",
                                 labels=["max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 stats.prefix_cache_query_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 stats.prefix_cache_hit_tokens)):
            counter = CounterMetricFamily(f"{VLLM}:{name}", doc, labels=["model_name"])
            counter.add_metric(model, value)
            yield counter


class ServerMetrics:
    """The counters and histograms the handlers update, and the text ``/metrics`` serves."""

    def __init__(self, engine_stats: Callable[[], Any], model_name: str = "",
                 page_size: int = 16) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
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
        self.registry.register(_EngineCollector(engine_stats, model_name, page_size))
        # The same counts under vLLM's names.
        reg, named = self.registry, ["model_name"]
        self.vllm_success = Counter(f"{VLLM}:request_success", "Requests finished, by reason",
                                    [*named, "finished_reason"], registry=reg)
        for reason in _VLLM_REASONS:
            self.vllm_success.labels(model_name, reason)
        self.vllm_prompt_tokens = Counter(f"{VLLM}:prompt_tokens", "Prompt tokens of "
                                          "finished requests", named, registry=reg)
        self.vllm_generation_tokens = Counter(f"{VLLM}:generation_tokens", "Tokens generated "
                                              "for finished requests", named, registry=reg)
        self.vllm_ttft = Histogram(f"{VLLM}:time_to_first_token_seconds", "Arrival to first "
                                   "output token", named, buckets=_TTFT_BUCKETS, registry=reg)
        self.vllm_tpot = Histogram(f"{VLLM}:time_per_output_token_seconds", "Mean time "
                                   "between output tokens after the first, per request",
                                   named, buckets=_TPOT_BUCKETS, registry=reg)
        self.vllm_e2e = Histogram(f"{VLLM}:e2e_request_latency_seconds", "Arrival to finish",
                                  named, buckets=_E2E_BUCKETS, registry=reg)
        for metric in (self.vllm_prompt_tokens, self.vllm_generation_tokens, self.vllm_ttft,
                       self.vllm_tpot, self.vllm_e2e):
            metric.labels(model_name)

    def record_outcome(self, outcome: str) -> None:
        """Count one generation request as finished with ``outcome`` (one of OUTCOMES)."""
        self.requests.labels(outcome).inc()
        if outcome in _VLLM_REASONS:
            self.vllm_success.labels(self.model_name, outcome).inc()

    def observe(self, output: RequestOutput) -> None:
        """Token counts and latencies of a request the engine finished."""
        name = self.model_name
        prompt = len(output.prompt_token_ids)
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.vllm_prompt_tokens.labels(name).inc(prompt)
        self.vllm_generation_tokens.labels(name).inc(generated)
        m = output.metrics
        if m is None:
            return
        e2e = max(m.finish_time - m.arrival_time, 0.0)
        self.e2e.observe(e2e)
        self.vllm_e2e.labels(name).observe(e2e)
        if m.first_token_time is None:
            return
        ttft = max(m.first_token_time - m.arrival_time, 0.0)
        self.ttft.observe(ttft)
        self.vllm_ttft.labels(name).observe(ttft)
        if len(output.token_ids) > 1:
            tpot = max(m.finish_time - m.first_token_time, 0.0) / (len(output.token_ids) - 1)
            self.tpot.observe(tpot)
            self.vllm_tpot.labels(name).observe(tpot)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
