"""`python -m loadtest.chaos`: load with everything that goes wrong in production mixed in, then check
that the server got through it: every request answered or cleanly refused, no KV block left in use,
/health 200.

    python -m loadtest.chaos --duration 120                      # launches `python -m server`
    python -m loadtest.chaos --launch "python -m server --model default --tensor-parallel-size 2"
    python -m loadtest.chaos --url http://127.0.0.1:8000 --pid 1234 --kill-workers

Each of `--concurrency` clients sends, back to back, one of: a normal request (streamed or not), a
stream it leaves mid-way, a malformed or wrongly typed body, a body over the server's size limit, a
body it stops sending half way, a huge `n` or `max_tokens`, a prompt longer than the context. With
`--kill-workers` (the default when the server was launched with parallel workers) a worker process of
the server is killed with SIGKILL every `--kill-every` seconds: the requests it was running must fail
cleanly (a 5xx with an OpenAI error body, or an error event) and the server must serve again.

What counts as unclean: a connection dropped by the server, a timeout, a 5xx without an OpenAI error
body, a stream that ends without [DONE], a 200 whose body is not a completion. Exit status 1 when any
happened, when KV blocks are still in use at the end, or when /health is not 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.launcher import add_server_to_load_args, server_to_load
from loadtest.soak import parse_metrics, served_model

DEFAULT_LAUNCH = "python -m server --model default --log-stats-interval 0"

# What each client does, with its weight.
ACTIONS: dict[str, int] = {
    "normal": 5,
    "stream": 5,
    "disconnect": 3,
    "malformed": 2,
    "wrong_type": 2,
    "oversized": 1,
    "truncated_body": 1,
    "huge_n": 1,
    "huge_max_tokens": 1,
    "too_long": 1,
}


@dataclass
class ChaosReport:
    duration_s: float
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # "ok", "refused_400", "failed_500", ...
    unclean: dict[str, int] = field(default_factory=dict)  # kind -> count; must stay empty
    actions: dict[str, int] = field(default_factory=dict)
    workers_killed: int = 0
    worker_restarts: float | None = None
    kv_blocks_used_end: float | None = None
    health_end: int | None = None

    @property
    def passed(self) -> bool:
        return not self.unclean and not self.kv_blocks_used_end and self.health_end == 200

    def lines(self) -> list[str]:
        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "none"

        return [
            f"duration:          {self.duration_s:.0f} s",
            f"requests:          {self.requests} ({fmt(self.actions)})",
            f"outcomes:          {fmt(self.outcomes)}",
            f"unclean:           {fmt(self.unclean)}",
            f"workers killed:    {self.workers_killed} (restarts counted by the server: {self.worker_restarts})",
            f"KV blocks in use:  {self.kv_blocks_used_end}",
            f"/health at the end: {self.health_end}",
            f"result:            {'PASS' if self.passed else 'FAIL'}",
        ]


def worker_pids(server_pid: int) -> list[int]:
    """The server's tensor/pipeline worker processes: its children started by multiprocessing's spawn
    (not the resource tracker). Linux lists children per thread, and the workers are started from the
    thread that loads the model."""
    children: list[str] = []
    for task in Path(f"/proc/{server_pid}/task").glob("*"):
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue
    out = []
    for pid in map(int, children):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            out.append(pid)
    return out


def kill_a_worker(server_pid: int) -> Callable[[], bool]:
    def kill() -> bool:
        pids = worker_pids(server_pid)
        if not pids:
            return False
        os.kill(random.choice(pids), signal.SIGKILL)
        return True

    return kill


def _is_error_body(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]


class Chaos:
    def __init__(
        self,
        base_url: str,
        model: str,
        duration_s: float,
        concurrency: int,
        seed: int = 0,
        kill_worker: Callable[[], bool] | None = None,
        kill_every_s: float = 20.0,
        max_body_bytes: int = 4 * 2**20,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.duration_s = duration_s
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.kill_worker = kill_worker
        self.kill_every_s = kill_every_s
        self.max_body_bytes = max_body_bytes
        self.headers = headers or {}
        self.outcomes: Counter[str] = Counter()
        self.unclean: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.killed = 0

    # ---- one request of each kind ---------------------------------------------------------------

    def _body(self, **extra: Any) -> dict[str, Any]:
        words = " ".join(self.rng.choice(["red", "blue", "green", "tea", "sky", "code"]) for _ in range(12))
        body = {
            "model": self.model,
            "prompt": words,
            "max_tokens": self.rng.randint(4, 24),
            "temperature": 0.7,
        }
        body.update(extra)
        return body

    def _judge(self, r: httpx.Response) -> None:
        """A whole (non-streamed) answer: a completion, or an error in OpenAI's shape."""
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code == 200:
            ok = isinstance(body, dict) and isinstance(body.get("choices"), list)
            self._count("ok" if ok else None, "200_without_choices")
        elif _is_error_body(body):
            kind = "refused" if r.status_code < 500 else "failed"
            self._count(f"{kind}_{r.status_code}", None)
        else:
            self._count(None, f"{r.status_code}_without_error_body")

    def _count(self, outcome: str | None, unclean: str | None) -> None:
        if outcome is not None:
            self.outcomes[outcome] += 1
        else:
            self.unclean[unclean or "unknown"] += 1

    async def _post(self, client: httpx.AsyncClient, body: Any, raw: bytes | None = None) -> None:
        if raw is not None:
            r = await client.post(
                "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
            )
        else:
            r = await client.post("/v1/completions", json=body)
        self._judge(r)

    async def _stream(self, client: httpx.AsyncClient, leave_after: int | None) -> None:
        body = self._body(stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self._judge(r)
                return
            seen = 0
            events: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    self._count("left_mid_stream", None)
                    return
        if not events or events[-1] != "[DONE]":
            self._count(None, "stream_without_done")
            return
        errors = [e for e in events[:-1] if '"error"' in e and _is_error_body(json.loads(e))]
        self._count("failed_event" if errors else "ok", None)

    async def _truncated_body(self) -> None:
        """Send the head and half the body, then close the connection."""
        host, port = self.base_url.removeprefix("http://").split(":")
        raw = json.dumps(self._body()).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n"
        )
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        writer.write(head.encode() + b"\r\n" + raw[: len(raw) // 2])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        self._count("abandoned_body", None)

    async def one(self, client: httpx.AsyncClient) -> None:
        action = self.rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        self.actions[action] += 1
        try:
            if action == "normal":
                await self._post(client, self._body())
            elif action == "stream":
                await self._stream(client, None)
            elif action == "disconnect":
                await self._stream(client, self.rng.choice([1, 2, 4]))
            elif action == "malformed":
                await self._post(client, None, raw=b'{"prompt": "hi", "max_tokens": ')
            elif action == "wrong_type":
                await self._post(client, self._body(max_tokens="many", temperature=[1]))
            elif action == "oversized":
                await self._post(
                    client, None, raw=b'{"prompt": "' + b"a" * (self.max_body_bytes + 16) + b'"}'
                )
            elif action == "truncated_body":
                await self._truncated_body()
            elif action == "huge_n":
                await self._post(client, self._body(n=10**6))
            elif action == "huge_max_tokens":
                await self._post(client, self._body(max_tokens=10**9))
            elif action == "too_long":
                await self._post(client, self._body(prompt=[17] * 10**6, max_tokens=4))
        except httpx.TimeoutException:
            self._count(None, "timeout")
        except (httpx.TransportError, OSError) as exc:
            self._count(None, f"connection_{type(exc).__name__}")

    # ---- the run --------------------------------------------------------------------------------

    async def _killer(self, end: float) -> None:
        assert self.kill_worker is not None
        while time.monotonic() + self.kill_every_s / 2 < end:
            await asyncio.sleep(self.kill_every_s / 2 + self.rng.random() * self.kill_every_s / 2)
            if time.monotonic() < end and await asyncio.to_thread(self.kill_worker):
                self.killed += 1

    async def _client(self, client: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            await self.one(client)

    async def run(self) -> ChaosReport:
        report = ChaosReport(duration_s=self.duration_s)
        timeout = httpx.Timeout(300.0, connect=30.0)
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=timeout, limits=limits, trust_env=False
        ) as client:
            end = time.monotonic() + self.duration_s
            tasks = [self._client(client, end) for _ in range(self.concurrency)]
            if self.kill_worker is not None:
                tasks.append(self._killer(end))
            await asyncio.gather(*tasks)
            metrics, report.health_end = await self._settle(client)
        report.requests = sum(self.actions.values())
        report.outcomes, report.unclean, report.actions = (
            dict(self.outcomes),
            dict(self.unclean),
            dict(self.actions),
        )
        report.workers_killed = self.killed
        report.worker_restarts = metrics.get("orca:worker_restarts_total")
        report.kv_blocks_used_end = metrics.get("orca:kv_cache_blocks_used")
        return report

    async def _settle(self, client: httpx.AsyncClient, wait_s: float = 120.0) -> tuple[dict[str, float], int]:
        """/metrics and /health once the server is idle and healthy again (a restart takes seconds)."""
        deadline = time.monotonic() + wait_s
        while True:
            health = (await client.get("/health")).status_code
            metrics = parse_metrics((await client.get("/metrics")).text)
            idle = not metrics.get("vllm:num_requests_running") and not metrics.get(
                "vllm:num_requests_waiting"
            )
            if (health == 200 and idle) or time.monotonic() > deadline:
                return metrics, health
            await asyncio.sleep(0.2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    add_server_to_load_args(p, "chaos", DEFAULT_LAUNCH, 120.0, "seconds of chaos (default 2 min)")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument(
        "--kill-workers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SIGKILL a worker process now and then (default: when the launched server is parallel)",
    )
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between worker kills, about")
    p.add_argument(
        "--max-body-size", type=int, default=4 * 2**20, help="the server's limit (oversized bodies)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    launched = args.url is None
    parallel = "--tensor-parallel-size" in args.launch or "--pipeline-parallel-size" in args.launch
    kill = args.kill_workers if args.kill_workers is not None else (launched and parallel)
    if kill and not launched and args.pid is None:
        raise SystemExit("--kill-workers needs the server's --pid")
    with server_to_load(args.url, args.launch, args.log, args.pid, "chaos") as (base_url, pid):
        chaos = Chaos(
            base_url,
            args.model or served_model(base_url, headers),
            args.duration,
            args.concurrency,
            seed=args.seed,
            kill_worker=kill_a_worker(pid) if kill and pid is not None else None,
            kill_every_s=args.kill_every,
            max_body_bytes=args.max_body_size,
            headers=headers,
        )
        report = asyncio.run(chaos.run())
    print("\n".join(report.lines()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
