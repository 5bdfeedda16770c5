"""Drive one run: send a workload's requests at their arrival times and collect their timelines."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from loadtest.client import Target, send_request
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec, Workload, arrival_times

_ARRIVAL_STREAM = 0x0A11  # arrivals draw from their own stream, so they do not shift the prompts


@dataclass(frozen=True)
class RunConfig:
    rate: float  # requests/s; math.inf sends everything at once (or closed loop with max_concurrency)
    num_requests: int | None = None
    duration: float | None = None  # seconds during which requests are sent
    burstiness: float = 1.0  # 1: Poisson; gamma shape otherwise
    max_concurrency: int | None = None  # requests in flight at most; arrivals wait for a free slot
    seed: int = 0
    # Which round of prompts the run sends (Workload.spec): a sweep's k-th rate sends round k, the same
    # prompts to every server at that rate, new ones at each rate.
    prompt_round: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("a run needs num_requests or duration")
        if math.isinf(self.rate) and self.num_requests is None and self.max_concurrency is None:
            raise ValueError("an infinite rate for a duration needs max_concurrency (a closed loop)")

    @property
    def closed_loop(self) -> bool:
        """Fixed concurrency for a duration: a new request as soon as one finishes, until time is up."""
        return math.isinf(self.rate) and self.num_requests is None


def make_client(base_url: str, api_key: str | None, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=30.0),
        # Every in-flight request needs its own connection; the default pool of 100 would queue
        # requests in the client and count the wait as server latency.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,  # never route benchmark traffic through a proxy from the environment
    )


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    config: RunConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send the run's requests and return their records in workload order."""
    times: list[float] | None = None
    specs: list[RequestSpec] = []
    if not config.closed_loop:
        rng = np.random.default_rng([config.seed, _ARRIVAL_STREAM])
        times = arrival_times(config.rate, rng, config.num_requests, config.duration, config.burstiness)
        # Built before the clock starts: text prompts re-encode, which must not delay the sends.
        specs = [workload.spec(i, config.prompt_round) for i in range(len(times))]
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def one(spec: RequestSpec, record: RequestRecord, t0: float) -> RequestRecord:
        try:
            await send_request(client, target, spec, record, t0)
        finally:
            if slots is not None:
                slots.release()
        if on_done is not None:
            on_done(record)
        return record

    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    index = 0
    while times is None or index < len(times):
        scheduled = times[index] if times is not None else 0.0
        delay = t0 + scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        spec = specs[index] if times is not None else workload.spec(index, config.prompt_round)
        if times is None:
            # Closed loop: a request arrives when a slot frees, and none arrives once time is up. The
            # check comes after building the spec (text prompts re-encode, which takes time), so a
            # request admitted before the deadline is also sent before it.
            scheduled = time.perf_counter() - t0
            if config.duration is not None and scheduled >= config.duration:
                if slots is not None:
                    slots.release()
                break
        record = RequestRecord(
            index=spec.index, prompt_len=spec.prompt_len, max_tokens=spec.output_len, scheduled_time=scheduled
        )
        tasks.append(asyncio.create_task(one(spec, record, t0)))
        index += 1
    return list(await asyncio.gather(*tasks))


async def warm_up(
    client: httpx.AsyncClient, target: Target, workload: Workload, count: int, max_tokens: int = 8
) -> list[RequestRecord]:
    """A few short requests before measuring (first-call costs: lazy init, allocator, caches).

    They use prompts from far outside the measured index range, so no measured prompt is pre-cached.
    """
    t0 = time.perf_counter()
    records = []
    for k in range(count):
        base = workload.spec(10_000_000 + k)
        spec = RequestSpec(base.index, base.prompt, base.prompt_len, min(max_tokens, base.output_len))
        record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, scheduled_time=0.0)
        records.append(await send_request(client, target, spec, record, t0))
    return records
