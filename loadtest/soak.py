"""`python -m loadtest.soak`: a long run of mixed streaming load with random client disconnects, to
show that nothing leaks: requests served, errors by kind, the server's RSS at the start and the end, and
KV blocks in use once the load stops (from /metrics; it must be 0).

    python -m loadtest.soak --duration 1200                      # launches `python -m server` itself
    python -m loadtest.soak --url http://127.0.0.1:8000 --pid 1234 --duration 180

Each of `--concurrency` workers sends requests back to back until the time is up: streamed completions
(token-id prompts) and chats, some non-streamed, and with probability `--disconnect` a client that
leaves before its first token or after a few chunks. With probability `--repeat` a request resends the
prompt of an earlier one, so the prefix cache is hit (and its blocks shared) under the same churn; at
the end, blocks the cache keeps count as free, and none may be held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import Target, build_payload, send_request
from loadtest.launcher import add_server_to_load_args, server_to_load
from loadtest.prompts import PromptBuilder
from loadtest.records import ErrorKind, RequestRecord
from loadtest.tokenizer import resolve_tokenizer
from loadtest.workload import RequestSpec, UniformLengths, Workload

DEFAULT_LAUNCH = "python -m server --model default --log-stats-interval 30"


@dataclass
class SoakReport:
    duration_s: float
    requests_sent: int = 0
    requests_served: int = 0  # complete answers (streams to [DONE], JSON bodies)
    disconnects: int = 0  # clients that left on purpose
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count (http_429, connection, ...)
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    rss_peak_mib: float | None = None
    warmup_s: float = 0.0
    rss_after_warmup_mib: float | None = None  # the baseline for growth: caches fill in the first minutes
    kv_blocks_used_end: float | None = None
    kv_blocks_cached_end: float | None = None  # kept by the prefix cache, held by nobody
    prefix_cache_hit_rate: float | None = None  # hit tokens / queried tokens over the run
    kv_usage_end: float | None = None
    requests_running_end: float | None = None
    requests_waiting_end: float | None = None

    def lines(self) -> list[str]:
        errors = ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        return [
            f"duration:            {self.duration_s:.0f} s",
            f"requests sent:       {self.requests_sent}",
            f"served:              {self.requests_served}",
            f"disconnects (meant): {self.disconnects}",
            f"errors by kind:      {errors}",
            f"server RSS:          start {_mib(self.rss_start_mib)}, end {_mib(self.rss_end_mib)}, "
            f"peak {_mib(self.rss_peak_mib)}",
            f"RSS growth after the first {self.warmup_s:.0f} s: {_growth(self.rss_after_warmup_mib, self.rss_end_mib)} "
            f"({_mib(self.rss_after_warmup_mib)} -> {_mib(self.rss_end_mib)})",
            f"KV blocks in use at the end: {self.kv_blocks_used_end} (usage {self.kv_usage_end}); "
            f"cached: {self.kv_blocks_cached_end}, prefix cache hit rate {self.prefix_cache_hit_rate}",
            f"running / waiting at the end: {self.requests_running_end} / {self.requests_waiting_end}",
        ]


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} MiB"


def _growth(before: float | None, after: float | None) -> str:
    return "n/a" if before is None or after is None else f"{100 * (after / before - 1):+.1f}%"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value, summed over labels (one model per server)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of process `pid` (psutil when installed, else Linux's /proc)."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), None)
        return int(kib) / 1024 if kib is not None else None
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, pid: int | None, model: str) -> None:
        self.args = args
        self.pid = pid
        self.rng = random.Random(args.seed)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        self.headers = headers or {}
        tokenizer = resolve_tokenizer(args.tokenizer, base_url, model, headers)
        builder = PromptBuilder(tokenizer)
        lengths = UniformLengths(args.input_min, args.input_max, args.output_min, args.output_max)
        self.ids = Workload("soak", builder, args.seed, as_text=False, lengths=lengths)
        self.texts = Workload("soak-text", builder, args.seed, as_text=True, lengths=lengths)
        self.completions = Target(base_url, model, "completions", temperature=0.7, request_timeout=300)
        self.chat = Target(base_url, model, "chat", temperature=0.7, request_timeout=300)
        self.base_url = base_url
        self.kinds: Counter[str] = Counter()
        self.sent = 0
        self.served = 0
        self.disconnects = 0
        self.rss_peak: float | None = None
        self.rss_after_warmup: float | None = None
        self.t0 = time.perf_counter()

    def _spec(self, index: int, chat: bool) -> RequestSpec:
        return (self.texts if chat else self.ids).spec(index)

    async def _disconnect(self, client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> None:
        """Leave before the first token (chunks == 0) or after a few chunks."""
        chunks = self.rng.choice([0, 0, 1, 2, 5, 10])
        async with client.stream("POST", target.path, json=build_payload(target, spec)) as r:
            if r.status_code != 200:
                self.kinds[ErrorKind.http_error(r.status_code)] += 1
                return
            seen = 0
            async for line in r.aiter_lines():
                if seen >= chunks:
                    break
                seen += line.startswith("data:")
        self.disconnects += 1

    async def _non_streamed(self, client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> None:
        body = build_payload(target, spec)
        body["stream"] = False
        body.pop("stream_options", None)
        r = await client.post(target.path, json=body, timeout=target.request_timeout)
        if r.status_code == 200:
            self.served += 1
        else:
            self.kinds[ErrorKind.http_error(r.status_code)] += 1

    async def one(self, client: httpx.AsyncClient, index: int) -> None:
        chat = self.rng.random() < self.args.chat_fraction
        target = self.chat if chat else self.completions
        if index > 1 and self.rng.random() < self.args.repeat:
            index = self.rng.randrange(1, index)  # an earlier request's prompt again
        spec = self._spec(index, chat)
        self.sent += 1
        roll = self.rng.random()
        try:
            if roll < self.args.disconnect:
                await self._disconnect(client, target, spec)
            elif roll < self.args.disconnect + self.args.non_streamed:
                await self._non_streamed(client, target, spec)
            else:
                record = RequestRecord(index, spec.prompt_len, spec.output_len, time.perf_counter() - self.t0)
                await send_request(client, target, spec, record, self.t0)
                if record.ok:
                    self.served += 1
                else:
                    self.kinds[record.error_kind or "unknown"] += 1
        except httpx.TransportError:
            self.kinds[ErrorKind.CONNECTION] += 1
        except httpx.TimeoutException:
            self.kinds[ErrorKind.TIMEOUT] += 1

    async def worker(self, client: httpx.AsyncClient, end: float, counter: list[int]) -> None:
        while time.monotonic() < end:
            counter[0] += 1
            rejected = self.kinds[ErrorKind.http_error(429)]
            await self.one(client, counter[0])
            if self.kinds[ErrorKind.http_error(429)] > rejected:
                await asyncio.sleep(0.5)  # back off after a 429, as a client honouring Retry-After would

    async def sample_rss(self, end: float) -> None:
        warm_at = time.monotonic() + min(self.args.warmup, self.args.duration)
        while time.monotonic() < end:
            rss = rss_mib(self.pid)
            if rss is not None:
                self.rss_peak = max(self.rss_peak or 0.0, rss)
                if self.rss_after_warmup is None and time.monotonic() >= warm_at:
                    self.rss_after_warmup = rss
            await asyncio.sleep(1.0)

    async def settle(self, client: httpx.AsyncClient) -> dict[str, float]:
        """/metrics once the server has nothing left to run (aborts land within an iteration)."""
        metrics: dict[str, float] = {}
        for _ in range(100):
            metrics = parse_metrics((await client.get("/metrics")).text)
            if (
                metrics.get("vllm:num_requests_running", 0) == 0
                and metrics.get("vllm:num_requests_waiting", 0) == 0
            ):
                break
            await asyncio.sleep(0.2)
        return metrics

    async def run(self) -> SoakReport:
        report = SoakReport(
            duration_s=self.args.duration, rss_start_mib=rss_mib(self.pid), warmup_s=self.args.warmup
        )
        limits = httpx.Limits(max_connections=self.args.concurrency * 2)
        timeout = httpx.Timeout(300.0, connect=30.0)
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, limits=limits, timeout=timeout, trust_env=False
        ) as client:
            end = time.monotonic() + self.args.duration
            counter = [0]
            progress = asyncio.create_task(self.progress(end))
            sampler = asyncio.create_task(self.sample_rss(end))
            await asyncio.gather(*(self.worker(client, end, counter) for _ in range(self.args.concurrency)))
            progress.cancel()
            await sampler
            metrics = await self.settle(client)
        report.requests_sent = self.sent
        report.requests_served = self.served
        report.disconnects = self.disconnects
        report.errors = dict(self.kinds)
        report.rss_end_mib = rss_mib(self.pid)
        report.rss_peak_mib = self.rss_peak
        report.rss_after_warmup_mib = self.rss_after_warmup
        report.kv_blocks_used_end = metrics.get("orca:kv_cache_blocks_used")
        report.kv_blocks_cached_end = metrics.get("orca:kv_cache_blocks_cached")
        queries = metrics.get("vllm:prefix_cache_queries_total")
        if queries:
            report.prefix_cache_hit_rate = round(
                metrics.get("vllm:prefix_cache_hits_total", 0.0) / queries, 4
            )
        report.kv_usage_end = metrics.get("vllm:kv_cache_usage_perc")
        report.requests_running_end = metrics.get("vllm:num_requests_running")
        report.requests_waiting_end = metrics.get("vllm:num_requests_waiting")
        return report

    async def progress(self, end: float) -> None:
        while True:
            await asyncio.sleep(30)
            left = max(end - time.monotonic(), 0)
            print(
                f"[soak] {left:.0f}s left: sent {self.sent}, served {self.served}, "
                f"disconnects {self.disconnects}, errors {dict(self.kinds)}, RSS {_mib(rss_mib(self.pid))}",
                file=sys.stderr,
                flush=True,
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    add_server_to_load_args(p, "soak", DEFAULT_LAUNCH, 1200.0, "seconds of load (default 20 min)")
    p.add_argument(
        "--warmup",
        type=float,
        default=300.0,
        help="seconds after which RSS is the baseline for growth (default 5 min: shape caches fill first)",
    )
    p.add_argument("--tokenizer", default=None, help="as in python -m loadtest (default: the model's)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.25, help="fraction of clients that leave early")
    p.add_argument("--non-streamed", type=float, default=0.1, help="fraction sent without stream")
    p.add_argument("--chat-fraction", type=float, default=0.3)
    p.add_argument("--repeat", type=float, default=0.3, help="fraction resending an earlier prompt")
    p.add_argument("--input-min", type=int, default=16)
    p.add_argument("--input-max", type=int, default=256)
    p.add_argument("--output-min", type=int, default=8)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    return p


def served_model(base_url: str, headers: dict[str, str]) -> str:
    r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30, trust_env=False)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.disconnect + args.non_streamed <= 1:
        raise SystemExit("--disconnect + --non-streamed must be within [0, 1]")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with server_to_load(args.url, args.launch, args.log, args.pid, "soak") as (base_url, pid):
        model = args.model or served_model(base_url, headers)
        report = asyncio.run(Soak(args, base_url, pid, model).run())
    print("\n".join(report.lines()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(report), indent=2))
    leaked = (report.kv_blocks_used_end or 0) > 0
    return 1 if leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
