"""Prometheus metrics under vLLM's names, in a registry of the app's own (several apps in one process
must not clash). Engine gauges are read from IterationLoop.stats() at scrape time; request timings are
observed by a RequestTracker per choice; per-iteration figures come from the loop's step listener."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.outputs import SchedulerStats, StepReport

# vLLM does the same: the `_created` series double the output and no dashboard reads them.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM's, so dashboards built for it read ours the same way. Its TTFT and TPOT buckets
# differ below half a second and share the rest.
_SLOW_SECONDS = (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *_SLOW_SECONDS)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *_SLOW_SECONDS)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's request_queue_time_seconds buckets are its latency ones.
_QUEUE_TIME_BUCKETS = _LATENCY_BUCKETS
REJECT_REASONS = ("queue_full", "draining", "timeout")


class _EngineCollector(Collector):
    """Scrape-time view of the loop: queue sizes, KV usage, preemptions."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        if stats is None:  # still loading: nothing to report yet
            return
        yield from self._families(
            GaugeMetricFamily,
            (
                ("vllm:num_requests_running", "Requests in the running batch.", stats.running),
                ("vllm:num_requests_waiting", "Requests waiting to be admitted.", stats.waiting),
                (
                    "vllm:kv_cache_usage_perc",
                    "Fraction of KV cache blocks in use (1 = full); cached blocks no request holds count as free.",
                    stats.kv_usage,
                ),
                ("orca:kv_cache_blocks_used", "KV cache blocks held by requests.", stats.kv_blocks_used),
                ("orca:kv_cache_blocks_total", "KV cache blocks in all.", stats.kv_blocks_total),
                (
                    "orca:kv_cache_blocks_cached",
                    "KV cache blocks holding a reusable prefix (held or evictable).",
                    stats.prefix_cache.cached_blocks,
                ),
            ),
        )
        yield from self._families(
            CounterMetricFamily,
            (
                (
                    "vllm:num_preemptions",
                    "Preemptions (requests recomputed for lack of KV blocks).",
                    stats.num_preemptions,
                ),
                ("orca:engine_steps", "Iterations run by the loop.", stats.num_steps),
                (
                    "vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    stats.prefix_cache.queries,
                ),
                (
                    "vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    stats.prefix_cache.hits,
                ),
                (
                    "orca:prompt_tokens_computed",
                    "Prompt tokens run through the model (prompt tokens minus prefix cache hits, plus "
                    "recomputation after preemption).",
                    stats.prefix_cache.computed_prompt_tokens,
                ),
                (
                    "orca:prefix_cache_evictions",
                    "Cached KV blocks whose memory was taken for new tokens.",
                    stats.prefix_cache.evictions,
                ),
                (
                    "orca:worker_restarts",
                    "Restarts of the tensor/pipeline worker processes after one died.",
                    stats.num_restarts,
                ),
                # Speculative decoding: the acceptance rate is accepted over proposed (vLLM's names too).
                (
                    "orca:spec_proposed_tokens",
                    "Proposed tokens verified (speculative decoding).",
                    stats.speculation.proposed_tokens,
                ),
                (
                    "orca:spec_accepted_tokens",
                    "Proposed tokens the model accepted (speculative decoding).",
                    stats.speculation.accepted_tokens,
                ),
                (
                    "vllm:spec_decode_num_drafts",
                    "Verifications of proposed tokens (one per request per step that proposed).",
                    stats.speculation.num_verifications,
                ),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "Proposed tokens verified.",
                    stats.speculation.proposed_tokens,
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "Proposed tokens accepted.",
                    stats.speculation.accepted_tokens,
                ),
            ),
        )

    def _families(
        self, kind: type[GaugeMetricFamily | CounterMetricFamily], rows: Iterable[tuple[str, str, float]]
    ) -> Iterator[Any]:
        """One metric family of `kind` per (name, help, value) row, labelled with the model's name."""
        for name, doc, v in rows:
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(v))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        labels = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens (prompt + decode) run per iteration.",
            labels,
            buckets=_ITERATION_TOKEN_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to first scheduling (in the waiting queue).",
            labels,
            buckets=_QUEUE_TIME_BUCKETS,
            registry=reg,
        )
        # No vLLM counterpart: requests refused by admission control or cut by the server's timeout.
        self.rejected = Counter(
            "orca:requests_rejected",
            "Requests refused (queue_full: 429, draining: 503 during shutdown) or timed out (408).",
            [*labels, "reason"],
            registry=reg,
        )
        for reason in REJECT_REASONS:  # present at 0, so a rate() over them works from the start
            self.rejected.labels(model_name, reason)
        # Every HTTP answer, by the route that took it (its path template, so ids in paths do not make
        # new series; "unmatched" for paths no route serves), method and status code.
        self.http_requests = Counter(
            "orca:http_requests",
            "HTTP requests answered, by route, method and status code.",
            [*labels, "route", "method", "status"],
            registry=reg,
        )
        reg.register(_EngineCollector(model_name, stats))
        # The children every token or step updates, looked up once: labels() costs ~15 us a call.
        self.model_iteration_tokens = self.iteration_tokens.labels(model_name)
        self.model_generation_tokens = self.generation_tokens.labels(model_name)
        # Running totals of the loop's own token counts, for the periodic throughput log line.
        self.step_prompt_tokens = 0
        self.step_decode_tokens = 0  # generated: each decoding request's own token, and accepted proposals

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def observe_iteration(self, report: StepReport) -> None:
        self.model_iteration_tokens.observe(report.num_tokens)
        if not report.failed:
            self.step_prompt_tokens += report.num_prompt_tokens
            self.step_decode_tokens += report.num_decode_tokens + report.num_spec_accepted

    def count_http(self, route: str, method: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, method, str(status)).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Timings of one choice, from submission to its finish."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._start = time.monotonic()
        self._first: float | None = None

    def on_queue_time(self, seconds: float) -> None:
        self._m.queue_time.labels(self._m.model_name).observe(seconds)

    def on_tokens(self, n: int, prompt_tokens: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        name = self._m.model_name
        if self._first is None:
            # The first token means the prompt's prefill is done: count its tokens now, not at the end.
            self._first = now
            self._m.ttft.labels(name).observe(now - self._start)
            self._m.prompt_tokens.labels(name).inc(prompt_tokens)
        self._m.model_generation_tokens.inc(n)

    def on_finish(self, completion_tokens: int, reason: str) -> None:
        now = time.monotonic()
        name = self._m.model_name
        self._m.e2e.labels(name).observe(now - self._start)
        self._m.request_success.labels(name, reason).inc()
        if self._first is not None and completion_tokens > 1:
            self._m.tpot.labels(name).observe((now - self._first) / (completion_tokens - 1))
