"""The periodic log line (vLLM's "Avg prompt throughput ..."): throughput since the previous line,
running and waiting requests, KV usage. Quiet while the server is idle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.outputs import SchedulerStats
from server.metrics import ServerMetrics

logger = logging.getLogger("server.stats")


@dataclass
class _Mark:
    time: float
    prompt_tokens: int
    decode_tokens: int
    num_steps: int
    cache_queries: int
    cache_hits: int
    spec_proposed: int
    spec_accepted: int


class StatsLogger:
    def __init__(self, metrics: ServerMetrics, stats: Callable[[], SchedulerStats | None]) -> None:
        self._metrics = metrics
        self._stats = stats
        self._last: _Mark | None = None

    def line(self) -> str | None:
        """The line for the interval since the previous call; None when nothing ran or waited."""
        stats = self._stats()
        if stats is None:
            return None
        now = _Mark(
            time.monotonic(),
            self._metrics.step_prompt_tokens,
            self._metrics.step_decode_tokens,
            stats.num_steps,
            stats.prefix_cache.queries,
            stats.prefix_cache.hits,
            stats.speculation.proposed_tokens,
            stats.speculation.accepted_tokens,
        )
        last, self._last = self._last, now
        if last is None:
            return None
        if now.num_steps == last.num_steps and stats.running == 0 and stats.waiting == 0:
            return None  # idle: no line every few seconds in the logs of a quiet server
        elapsed = max(now.time - last.time, 1e-9)
        queries = now.cache_queries - last.cache_queries
        hit_rate = (now.cache_hits - last.cache_hits) / queries * 100 if queries else 0.0
        proposed = now.spec_proposed - last.spec_proposed
        spec = (
            f", Speculative acceptance: {(now.spec_accepted - last.spec_accepted) / proposed * 100:.1f}% "
            f"of {proposed} tokens"
            if proposed
            else ""
        )
        return (
            f"Avg prompt throughput: {(now.prompt_tokens - last.prompt_tokens) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(now.decode_tokens - last.decode_tokens) / elapsed:.1f} tokens/s, "
            f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, "
            f"KV cache usage: {stats.kv_usage * 100:.1f}% ({stats.kv_blocks_used}/{stats.kv_blocks_total} "
            f"blocks), Prefix cache hit rate: {hit_rate:.1f}%, Preemptions: {stats.num_preemptions}{spec}"
        )

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                text = self.line()
            except Exception:  # a logging bug must not end the logger for good
                logger.exception("stats line failed")
                continue
            if text is not None:
                logger.info("%s", text)
