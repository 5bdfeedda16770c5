"""A sweep: every configuration (a running server, or a command that starts one) at every request rate.

Sequential (default): one server at a time, all its rates, then the next. Interleaved: every server
up at once (idle ones cost memory, not CPU) and, rate by rate, each configuration in turn, so slow
drift in a shared machine's load (other jobs, thermal limits) lands on all configurations alike
instead of on whichever happened to run last.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from loadtest.client import Target
from loadtest.launcher import LaunchedServer, ServerStartError
from loadtest.metrics import SLO, summarize
from loadtest.records import RequestRecord
from loadtest.results import RunResult, format_rate
from loadtest.runner import RunConfig, make_client, run_load, warm_up
from loadtest.server_metrics import counter_deltas, pooled_deltas, scrape
from loadtest.tokenizer import PromptTokenizer, resolve_tokenizer
from loadtest.workload import Workload

# Builds the workload once the tokenizer is known: (tokenizer, text prompts?) -> Workload.
WorkloadFactory = Callable[[PromptTokenizer, bool], Workload]


class BenchmarkError(RuntimeError):
    pass


# Errors that end one configuration's part of a sweep (the others still run).
CONFIG_ERRORS: tuple[type[BaseException], ...] = (
    ServerStartError,
    BenchmarkError,
    httpx.HTTPError,
    OSError,
    RuntimeError,
)


@dataclass
class Config:
    """One thing to benchmark: a running server, or a command that starts one."""

    label: str
    command: str | None  # None: the server at base_url is already running
    base_url: str
    log_path: Path | None = None  # where a launched server's output goes


@dataclass(frozen=True)
class SweepOptions:
    rates: Sequence[float]
    num_requests: int | None
    duration: float | None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    temperature: float = 0.0
    request_timeout: float = 600.0
    launch_timeout: float = 600.0
    tokenizer: str | None = None
    prompt_format: str = "auto"  # auto, ids or text
    warmup_requests: int = 2
    slos: Sequence[SLO] = ()
    show_progress: bool = True
    ignore_eos: bool = True  # client.Target.ignore_eos
    # With interleave: each rate runs in this many turns per configuration, alternating (A B A B ...),
    # each a slice of the duration or the requests with prompts of its own, pooled into one result.
    slices: int = 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def run_config(self, rate: float, slice_: int = 0) -> RunConfig:
        """The run at `rate` (its `slice_`-th turn of `slices`), with the prompts of its own round (its
        place in the sweep), so no turn resends prompts a server's prefix cache holds."""
        round_ = (self.rates.index(rate) if rate in self.rates else 0) * self.slices + slice_
        n = self.num_requests
        return RunConfig(
            rate,
            None if n is None else n // self.slices + (slice_ < n % self.slices),
            None if self.duration is None else self.duration / self.slices,
            self.burstiness,
            self.max_concurrency,
            self.seed,
            round_,
        )


def list_models(base_url: str, headers: dict[str, str]) -> dict[str, str | None]:
    """Served model ids, in the server's order, each with its `root` (where it was loaded from)."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=30.0, trust_env=False) as client:
        resp = client.get("/v1/models")
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    return {str(c["id"]): (str(c["root"]) if c.get("root") else None) for c in cards}


def pick_model(requested: str | None, base_url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """--model, or the first served model; with the path it was loaded from, if the server says."""
    try:
        served = list_models(base_url, headers)
    except (httpx.HTTPError, ValueError, KeyError):
        if requested is None:
            raise
        return requested, None  # a server without /v1/models can still be benchmarked by name
    if requested is not None:
        return requested, served.get(requested)
    if not served:
        raise BenchmarkError(f"{base_url}/v1/models lists no model; pass --model")
    return next(iter(served.items()))


_API_KEY = re.compile(r"(--api-key[= ])\S+")


def redact(value: Any) -> Any:
    """API keys out of what is written to a results file (argv, --launch commands)."""
    if isinstance(value, str):
        return _API_KEY.sub(r"\1***", value)
    if isinstance(value, list):
        redacted = [redact(v) for v in value]
        for i, word in enumerate(redacted[:-1]):
            if word == "--api-key":
                redacted[i + 1] = "***"
        return redacted
    return value


@dataclass
class Prepared:
    """A configuration ready to measure: its server up, its model, tokenizer and workload chosen."""

    config: Config
    target: Target
    tokenizer: PromptTokenizer
    workload: Workload
    server: LaunchedServer | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        closer = getattr(self.tokenizer, "close", None)  # the server tokenizer's HTTP client
        if closer is not None:
            closer()
        if self.server is not None:
            self.server.stop()


def prepare(config: Config, opts: SweepOptions, make_workload: WorkloadFactory, console: Console) -> Prepared:
    server: LaunchedServer | None = None
    if config.command is not None:
        assert config.log_path is not None
        server = LaunchedServer(config.command, config.log_path, health_timeout=opts.launch_timeout)
        env = " ".join(f"{k}={v}" for k, v in server.env.items())
        shown = " ".join([env, *server.argv]) if env else " ".join(server.argv)
        console.print(f"[bold]{config.label}[/]: starting {shown} (log: {config.log_path})")
        server.start()
        config.base_url = server.base_url
    try:
        model, root = pick_model(opts.model, config.base_url, opts.headers)
        tokenizer = resolve_tokenizer(opts.tokenizer, config.base_url, model, opts.headers, hint=root)
        workload = make_workload(tokenizer, opts.endpoint == "chat" or opts.prompt_format == "text")
    except BaseException:
        if server is not None:
            server.stop()
        raise
    target = Target(
        config.base_url, model, opts.endpoint, opts.temperature, opts.request_timeout, opts.ignore_eos
    )
    console.print(f"[bold]{config.label}[/]: model {model}, tokenizer {tokenizer.description}")
    return Prepared(config, target, tokenizer, workload, server)


def _refused_ids(records: Sequence[RequestRecord]) -> bool:
    return bool(records) and all(r.error_kind in ("http_400", "http_422") for r in records)


async def warm(prepared: Prepared, opts: SweepOptions, console: Console) -> None:
    """Warm the server up; in auto mode also learn whether it takes token-id prompts."""
    auto_ids = opts.prompt_format == "auto" and not prepared.workload.as_text
    count = max(opts.warmup_requests, 1 if auto_ids else 0)
    if count == 0:
        return
    target = prepared.target
    async with make_client(target.base_url, opts.api_key, opts.request_timeout) as client:
        records = await warm_up(client, target, prepared.workload, count)
        if auto_ids and _refused_ids(records):
            console.print("[yellow]server refused token-id prompts; sending text prompts of exact length")
            prepared.workload = prepared.workload.with_text_prompts()
            records = await warm_up(client, target, prepared.workload, count)
    failed = [r for r in records if not r.ok]
    if failed and len(failed) == len(records):
        raise BenchmarkError(f"every warm-up request failed, e.g. {failed[0].error_kind}: {failed[0].error}")


async def run_rate(
    prepared: Prepared, rate: float, opts: SweepOptions, console: Console, slice_: int = 0
) -> RunResult:
    config, target, workload = prepared.config, prepared.target, prepared.workload
    run_config = opts.run_config(rate, slice_)
    async with make_client(target.base_url, opts.api_key, opts.request_timeout) as client:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not opts.show_progress,
        ) as progress:
            task = progress.add_task(
                f"{config.label} @ {format_rate(rate)} req/s", total=run_config.num_requests, errors=0
            )
            errors = 0

            def done(record: RequestRecord) -> None:
                nonlocal errors
                errors += record.error_kind is not None
                progress.update(task, advance=1, errors=errors)

            before = await scrape(client)
            records = await run_load(client, target, workload, run_config, on_done=done)
            after = await scrape(client)
    summary = summarize(records, opts.slos)
    summary.extras["server"] = counter_deltas(before, after)
    extras = {
        "command": redact(config.command),
        "base_url": target.base_url,
        "model": target.model,
        "endpoint": target.endpoint,
        "prompt_format": "text" if workload.as_text else "ids",
        "tokenizer": prepared.tokenizer.description,
        "workload": workload.name,
    }
    if summary.errors:
        first = next(r for r in records if r.error_kind is not None)
        console.print(f"[red]{config.label} @ {format_rate(rate)}: {summary.errors}; first: {first.error}")
    return RunResult(config.label, rate, summary, records, extras)


def pool_turns(turns: Sequence[RunResult], slos: Sequence[SLO] = ()) -> RunResult:
    """A configuration's turns at one rate as one run: their records on one timeline (each turn's times
    shifted past the turns before it), its duration the turns' durations summed (what the other
    configurations ran in between counts for none)."""
    if len(turns) == 1:
        return turns[0]
    records: list[RequestRecord] = []
    offset = 0.0
    for turn in turns:
        records += [shifted(r, offset) for r in turn.records]
        offset += turn.summary.duration_s
    summary = summarize(records, slos, duration=offset)
    summary.extras["server"] = pooled_deltas([t.summary.extras.get("server", {}) for t in turns])
    first = turns[0]
    return RunResult(first.label, first.rate, summary, records, {**first.extras, "turns": len(turns)})


def shifted(r: RequestRecord, dt: float) -> RequestRecord:
    return replace(
        r,
        scheduled_time=r.scheduled_time + dt,
        send_time=r.send_time + dt,
        first_token_time=None if r.first_token_time is None else r.first_token_time + dt,
        token_times=[t + dt for t in r.token_times],
        end_time=None if r.end_time is None else r.end_time + dt,
    )


def run_sweep(
    configs: Sequence[Config],
    opts: SweepOptions,
    make_workload: WorkloadFactory,
    console: Console,
    on_run: Callable[[RunResult], None],
    interleave: bool = False,
) -> int:
    """Measure every configuration at every rate; returns how many configurations failed."""
    if interleave:
        return _run_interleaved(configs, opts, make_workload, console, on_run)
    failures = 0
    for config in configs:
        try:
            prepared = prepare(config, opts, make_workload, console)
            try:
                asyncio.run(_all_rates(prepared, opts, console, on_run))
            finally:
                prepared.close()
        except CONFIG_ERRORS as exc:
            failures += 1
            console.print(f"[red]{config.label}: {exc}")
    return failures


async def _all_rates(
    prepared: Prepared, opts: SweepOptions, console: Console, on_run: Callable[[RunResult], None]
) -> None:
    await warm(prepared, opts, console)
    for rate in opts.rates:
        on_run(await run_rate(prepared, rate, opts, console))


def _run_interleaved(
    configs: Sequence[Config],
    opts: SweepOptions,
    make_workload: WorkloadFactory,
    console: Console,
    on_run: Callable[[RunResult], None],
) -> int:
    failures = 0
    with ExitStack() as stack:
        ready: list[Prepared] = []
        for config in configs:
            try:
                prepared = prepare(config, opts, make_workload, console)
            except CONFIG_ERRORS as exc:
                failures += 1
                console.print(f"[red]{config.label}: {exc}")
                continue
            stack.callback(prepared.close)
            ready.append(prepared)

        async def interleaved() -> int:
            failed = 0
            live: list[Prepared] = []
            for prepared in ready:
                try:
                    await warm(prepared, opts, console)
                    live.append(prepared)
                except CONFIG_ERRORS as exc:
                    failed += 1
                    console.print(f"[red]{prepared.config.label}: {exc}")
            for rate in opts.rates:
                turns: dict[str, list[RunResult]] = {p.config.label: [] for p in live}
                for slice_ in range(opts.slices):
                    for prepared in list(live):
                        try:
                            turns[prepared.config.label].append(
                                await run_rate(prepared, rate, opts, console, slice_)
                            )
                        except CONFIG_ERRORS as exc:
                            failed += 1
                            live.remove(prepared)
                            console.print(f"[red]{prepared.config.label}: {exc}")
                for prepared in live:
                    on_run(pool_turns(turns[prepared.config.label], opts.slos))
            return failed

        failures += asyncio.run(interleaved())
    return failures
