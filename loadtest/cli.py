"""`python -m loadtest`: benchmark OpenAI-compatible servers over a sweep of request rates.

    python -m loadtest --request-rates 0.5,1,2,4 --num-requests 100 --output results.json \\
        --launch "python -m server --model default --scheduling iteration" --label iteration \\
        --launch "python -m server --model default --scheduling request" --label request

Without --launch it benchmarks the server at --base-url. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

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
from loadtest.prompts import PromptBuilder
from loadtest.records import RequestRecord
from loadtest.report import make_console, print_report
from loadtest.results import BenchmarkResults, RunResult, format_rate, machine_info
from loadtest.runner import RunConfig, make_client, run_load, warm_up
from loadtest.server_metrics import counter_deltas, scrape
from loadtest.tokenizer import PromptTokenizer, resolve_tokenizer
from loadtest.workload import UniformLengths, Workload, load_jsonl, random_lengths

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_REQUESTS = 100


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]  # float("inf") parses "inf"
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive numbers or inf: {text!r}")
    return rates


def parse_slo(text: str) -> SLO:
    try:
        return SLO.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server to benchmark (without --launch)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument(
        "--launch",
        action="append",
        default=[],
        metavar="CMD",
        help="start this server command on a free loopback port for its runs, then stop it (repeatable; "
        "'--host 127.0.0.1 --port N' is appended unless CMD contains {port})",
    )
    g.add_argument("--label", action="append", default=[], help="name of each --launch configuration")
    g.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for /health")
    g.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --base-url that is not loopback (by default all traffic stays on this machine)",
    )

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("orca", "random", "file"), default="orca")
    g.add_argument("--input-len-min", type=int, default=32, help="orca: shortest prompt (tokens)")
    g.add_argument("--input-len-max", type=int, default=512, help="orca: longest prompt (tokens)")
    g.add_argument("--output-len-min", type=int, default=1, help="orca: shortest output (tokens)")
    g.add_argument("--output-len-max", type=int, default=128, help="orca: longest output (tokens)")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random: lengths uniform in L*(1 +- ratio)"
    )
    g.add_argument("--dataset-path", type=Path, help='file: JSONL of {"prompt": ..., "output_len"?: ...}')
    g.add_argument("--file-output-len", type=int, default=128, help="file: output length when not given")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory, or 'server' for the server's /tokenize (default: the served "
        "model's directory, else the default model's, else the server's)",
    )
    g.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="send prompts as token ids (exact lengths) or text; auto: ids for completions, falling "
        "back to text if the server refuses them",
    )
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("traffic")
    g.add_argument(
        "--request-rates",
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="comma-separated requests/s, 'inf' for all at once (default: inf)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 is Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument(
        "--num-requests", type=int, default=None, help=f"per rate (default {DEFAULT_NUM_REQUESTS})"
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals per rate instead of a request count (rate inf: closed loop, needs "
        "--max-concurrency)",
    )
    g.add_argument("--warmup-requests", type=int, default=2, help="short unmeasured requests per server")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--temperature", type=float, default=0.0)

    g = p.add_argument_group("results")
    g.add_argument("--slo", action="append", type=parse_slo, default=[], help="e.g. ttft:500, tpot:100 (ms)")
    g.add_argument(
        "--at-latency",
        default="",
        help="median normalized latencies (ms/token, comma-separated) at which to compare configurations",
    )
    g.add_argument(
        "--output",
        type=Path,
        default=None,
        help="results JSON (default loadtest-results/<UTC time>.json); plots are written beside it",
    )
    g.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where launched servers' logs go (default: beside --output)",
    )
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    return p


def is_loopback(base_url: str) -> bool:
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auto_labels(commands: Sequence[str]) -> list[str]:
    """Name each launch by what sets it apart: `--scheduling request` -> 'scheduling=request'.

    A flag whose value differs is named with its value; a flag only some commands have is named
    alone; a command with nothing of its own (the baseline) is 'base'.
    """
    words = [shlex.split(c) for c in commands]
    if len(words) == 1:
        return ["server"]
    common = set.intersection(*(set(w) for w in words))
    labels = []
    for argv in words:
        parts = []
        for i, word in enumerate(argv):
            if word in common:
                continue
            flag = argv[i - 1] if i > 0 and argv[i - 1].startswith("-") else None
            if word.startswith("-"):
                parts.append(word.lstrip("-"))
            elif flag is not None and flag in common:
                parts.append(f"{flag.lstrip('-')}={word}")
            else:
                parts.append(word)
        labels.append(" ".join(parts) or "base")
    return labels


@dataclass
class Config:
    """One thing to benchmark: a running server, or a command that starts one."""

    label: str
    command: str | None  # None: the server at base_url is already running
    base_url: str


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.label and args.launch and len(args.label) != len(args.launch):
        parser.error("give one --label per --launch (or none)")
    if len(args.label) > 1 and not args.launch:
        parser.error("several --label values need as many --launch commands")
    if not args.launch and not args.allow_remote and not is_loopback(args.base_url):
        parser.error(f"{args.base_url} is not loopback; pass --allow-remote to benchmark another machine")
    # Workload mistakes are caught here, before any server is started for them.
    try:
        if args.workload == "file":
            if args.dataset_path is None:
                parser.error("--workload file needs --dataset-path")
            load_jsonl(args.dataset_path)
        else:
            make_lengths(args)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.endpoint == "chat" and args.prompt_format == "ids":
        parser.error("the chat endpoint takes text prompts; use --prompt-format text or auto")
    if args.num_requests is None and args.duration is None:
        args.num_requests = DEFAULT_NUM_REQUESTS
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    for rate in args.request_rates:
        try:
            RunConfig(rate, args.num_requests, args.duration, args.burstiness, args.max_concurrency)
        except ValueError as exc:
            parser.error(str(exc))


def make_lengths(args: argparse.Namespace) -> UniformLengths:
    if args.workload == "random":
        return random_lengths(args.random_input_len, args.random_output_len, args.random_range_ratio)
    return UniformLengths(args.input_len_min, args.input_len_max, args.output_len_min, args.output_len_max)


def make_workload(args: argparse.Namespace, tokenizer: PromptTokenizer, as_text: bool) -> Workload:
    builder = PromptBuilder(tokenizer)
    if args.workload == "file":
        entries = load_jsonl(args.dataset_path)
        return Workload(
            "file", builder, args.seed, as_text, entries=entries, default_output_len=args.file_output_len
        )
    return Workload(args.workload, builder, args.seed, as_text, lengths=make_lengths(args))


class BenchmarkError(RuntimeError):
    pass


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


def _refused_ids(records: Sequence[RequestRecord]) -> bool:
    return bool(records) and all(r.error_kind in ("http_400", "http_422") for r in records)


async def _warm_up(
    args: argparse.Namespace, target: Target, workload: Workload, console: Console
) -> Workload:
    """Warm the server up; in auto mode also learn whether it takes token-id prompts."""
    count = max(args.warmup_requests, 1 if args.prompt_format == "auto" and not workload.as_text else 0)
    if count == 0:
        return workload
    async with make_client(target.base_url, args.api_key, args.request_timeout) as client:
        records = await warm_up(client, target, workload, count)
        if args.prompt_format == "auto" and not workload.as_text and _refused_ids(records):
            console.print("[yellow]server refused token-id prompts; sending text prompts of exact length")
            workload = workload.with_text_prompts()
            records = await warm_up(client, target, workload, count)
    failed = [r for r in records if not r.ok]
    if failed and len(failed) == len(records):
        raise BenchmarkError(f"every warm-up request failed, e.g. {failed[0].error_kind}: {failed[0].error}")
    return workload


async def _run_rates(
    args: argparse.Namespace,
    config: Config,
    target: Target,
    workload: Workload,
    tokenizer: PromptTokenizer,
    console: Console,
    on_run: Callable[[RunResult], None],
) -> None:
    workload = await _warm_up(args, target, workload, console)
    async with make_client(target.base_url, args.api_key, args.request_timeout) as client:
        for rate in args.request_rates:
            run_cfg = RunConfig(
                rate, args.num_requests, args.duration, args.burstiness, args.max_concurrency, args.seed
            )
            with Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("errors {task.fields[errors]}"),
                TimeElapsedColumn(),
                console=console,
                disable=args.no_progress,
                transient=False,
            ) as progress:
                task = progress.add_task(
                    f"{config.label} @ {format_rate(rate)} req/s", total=args.num_requests, errors=0
                )
                errors = 0

                def done(record: RequestRecord, task_id: Any = task) -> None:
                    nonlocal errors
                    errors += record.error_kind is not None
                    progress.update(task_id, advance=1, errors=errors)

                before = await scrape(client)
                records = await run_load(client, target, workload, run_cfg, on_done=done)
                after = await scrape(client)
            summary = summarize(records, args.slo)
            summary.extras["server"] = counter_deltas(before, after)
            extras = {
                "command": _redact(config.command),
                "base_url": target.base_url,
                "model": target.model,
                "endpoint": target.endpoint,
                "prompt_format": "text" if workload.as_text else "ids",
                "tokenizer": tokenizer.description,
                "workload": workload.name,
            }
            on_run(RunResult(config.label, rate, summary, records, extras))
            if summary.errors:
                first = next(r for r in records if r.error_kind is not None)
                console.print(
                    f"[red]{config.label} @ {format_rate(rate)}: {summary.errors}; first: {first.error}"
                )


def bench_config(
    args: argparse.Namespace,
    config: Config,
    log_path: Path,
    console: Console,
    on_run: Callable[[RunResult], None],
) -> None:
    server: LaunchedServer | None = None
    tokenizer: PromptTokenizer | None = None
    if config.command is not None:
        server = LaunchedServer(config.command, log_path, health_timeout=args.launch_timeout)
        console.print(f"[bold]{config.label}[/]: starting {' '.join(server.argv)} (log: {log_path})")
        server.start()
        config.base_url = server.base_url
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model, root = pick_model(args.model, config.base_url, headers)
        tokenizer = resolve_tokenizer(args.tokenizer, config.base_url, model, headers, hint=root)
        as_text = args.endpoint == "chat" or args.prompt_format == "text"
        workload = make_workload(args, tokenizer, as_text)
        target = Target(config.base_url, model, args.endpoint, args.temperature, args.request_timeout)
        console.print(f"[bold]{config.label}[/]: model {model}, tokenizer {tokenizer.description}")
        asyncio.run(_run_rates(args, config, target, workload, tokenizer, console, on_run))
    finally:
        closer = getattr(tokenizer, "close", None)  # the server tokenizer's HTTP client
        if closer is not None:
            closer()
        if server is not None:
            server.stop()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, SLO):
        return f"{value.metric}:{value.threshold_ms:g}"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.base_url = normalize_base_url(args.base_url)
    validate(args, parser)
    console = make_console()
    started = dt.datetime.now(dt.timezone.utc)
    output: Path = args.output or Path("loadtest-results") / f"{started:%Y%m%dT%H%M%SZ}.json"
    stem = output.with_suffix("")

    if args.launch:
        labels = args.label or auto_labels(args.launch)
        configs = [Config(label, cmd, "") for label, cmd in zip(labels, args.launch, strict=True)]
    else:
        configs = [Config(args.label[0] if args.label else "server", None, args.base_url)]

    results = BenchmarkResults(
        config={
            "argv": _redact(list(sys.argv[1:] if argv is None else argv)),
            "started_utc": started.isoformat(timespec="seconds"),
            "machine": machine_info(),
            # The API key stays out of a file that is meant to be shared.
            "args": {k: _redact(_jsonable(v)) for k, v in vars(args).items() if k != "api_key"},
        }
    )

    def record_run(run: RunResult) -> None:
        results.runs.append(run)
        results.save(output)  # after every run, so a sweep that fails later keeps what it measured

    failures = 0
    for config in configs:
        log_name = f"{stem.name}-server-{_slug(config.label)}.log"
        log_path = args.log_dir / log_name if args.log_dir else stem.with_name(log_name)
        try:
            bench_config(args, config, log_path, console, record_run)
        except (ServerStartError, BenchmarkError, httpx.HTTPError, OSError, RuntimeError) as exc:
            failures += 1
            console.print(f"[red]{config.label}: {exc}")
    if not results.runs:
        console.print("[red]no run completed")
        return 1
    console.print(f"results: {output}")
    latencies = [float(x) for x in args.at_latency.split(",") if x.strip()]
    print_report(results.runs, latencies, console)
    if not args.no_plot:
        from loadtest.plots import write_plots  # matplotlib loads in seconds; only when plotting

        for path in write_plots(results.runs, stem):
            console.print(f"plot: {path}")
    return 1 if failures else 0


_API_KEY = re.compile(r"(--api-key[= ])\S+")


def _redact(value: Any) -> Any:
    """API keys out of what is written to the results file (argv, --launch commands)."""
    if isinstance(value, str):
        return _API_KEY.sub(r"\1***", value)
    if isinstance(value, list):
        redacted = [_redact(v) for v in value]
        for i, word in enumerate(redacted[:-1]):
            if word == "--api-key":
                redacted[i + 1] = "***"
        return redacted
    return value


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_") or "server"
