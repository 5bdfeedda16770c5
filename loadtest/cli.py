"""`python -m loadtest`: benchmark OpenAI-compatible servers over a sweep of request rates.

    python -m loadtest --request-rates 0.5,1,2,4 --num-requests 100 --output results.json \\
        --launch "python -m server --model default --scheduling iteration" --label iteration \\
        --launch "python -m server --model default --scheduling request" --label request

Without --launch it benchmarks the server at --base-url. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from engine.cli_args import from_flags
from loadtest.metrics import SLO
from loadtest.prompts import PromptBuilder
from loadtest.quoting import quoting_tasks
from loadtest.report import make_console, print_report
from loadtest.results import BenchmarkResults, RunResult, machine_info
from loadtest.runner import RunConfig
from loadtest.sweep import Config, SweepOptions, redact, run_sweep
from loadtest.tokenizer import PromptTokenizer
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


def add_server_args(g: argparse._ArgumentGroup) -> None:
    """Which servers to measure (shared by python -m loadtest and python -m loadtest.multiturn)."""
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server to benchmark (without --launch)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
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


def validate_servers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.label and args.launch and len(args.label) != len(args.launch):
        parser.error("give one --label per --launch (or none)")
    if len(args.label) > 1 and not args.launch:
        parser.error("several --label values need as many --launch commands")
    if not args.launch and not args.allow_remote and not is_loopback(args.base_url):
        parser.error(f"{args.base_url} is not loopback; pass --allow-remote to benchmark another machine")


def doc_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A load-test script's parser whose --help prints the module docstring as written."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def server_parser(prog: str, doc: str | None) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    """A load generator's parser and its "server" group, with the flags that say which servers to
    measure (shared by python -m loadtest and python -m loadtest.multiturn)."""
    p = doc_parser(prog, doc)
    g = p.add_argument_group("server")
    add_server_args(g)
    return p, g


def build_parser() -> argparse.ArgumentParser:
    p, g = server_parser("python -m loadtest", __doc__)
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument(
        "--interleave",
        action="store_true",
        help="start every --launch server at once and run the configurations in turn at each rate, so "
        "drift in a shared machine's load falls on all of them alike",
    )
    g.add_argument(
        "--slices",
        type=int,
        default=1,
        help="with --interleave: run each rate in this many turns per configuration, alternating (A B A B "
        "...), each a slice of --duration or --num-requests with prompts of its own, pooled into one "
        "result, so a machine whose speed drifts over minutes weighs on every configuration alike (a "
        "closed loop drains at each turn's end: for long requests under high concurrency keep 1)",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=("orca", "random", "file", "quote"),
        default="orca",
        help="quote: answers that quote their prompts (code edits, fixed texts, quoted passages: "
        "loadtest/quoting.py), for speculative decoding",
    )
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
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exact output lengths (min_tokens = max_tokens, EOS ignored: the default); --no-ignore-eos "
        "lets each output end at the model's end of turn, as a client's does",
    )

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


def parse_server_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """A load generator's flags, the server's base URL normalised and the server flags checked."""
    args = parser.parse_args(argv)
    args.base_url = normalize_base_url(args.base_url)
    validate_servers(args, parser)
    return args


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
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
    if args.slices < 1:
        parser.error("--slices must be >= 1")
    if args.slices > 1 and not args.interleave:
        parser.error("--slices needs --interleave (the turns alternate between the configurations)")
    if args.num_requests is not None and args.num_requests < args.slices:
        parser.error("--slices cannot exceed --num-requests (every turn sends at least one request)")
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
    if args.workload == "quote":
        return Workload("quote", builder, args.seed, as_text, entries=quoting_tasks(tokenizer, args.seed))
    return Workload(args.workload, builder, args.seed, as_text, lengths=make_lengths(args))


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
    args = parse_server_args(parser, argv)
    validate(args, parser)
    console = make_console()
    started = dt.datetime.now(dt.timezone.utc)
    output: Path = args.output or Path("loadtest-results") / f"{started:%Y%m%dT%H%M%SZ}.json"
    stem = output.with_suffix("")

    if args.launch:
        labels = args.label or auto_labels(args.launch)
        configs = [
            Config(label, cmd, "", _log_path(args, stem, label))
            for label, cmd in zip(labels, args.launch, strict=True)
        ]
    else:
        configs = [Config(args.label[0] if args.label else "server", None, args.base_url)]

    results = BenchmarkResults(
        config={
            "argv": redact(list(sys.argv[1:] if argv is None else argv)),
            "started_utc": started.isoformat(timespec="seconds"),
            "machine": machine_info(),
            # The API key stays out of a file that is meant to be shared.
            "args": {k: redact(_jsonable(v)) for k, v in vars(args).items() if k != "api_key"},
        }
    )

    def record_run(run: RunResult) -> None:
        results.runs.append(run)
        results.save(output)  # after every run, so a sweep that fails later keeps what it measured

    opts = from_flags(
        SweepOptions, args, rates=args.request_rates, slos=args.slo, show_progress=not args.no_progress
    )
    failures = run_sweep(
        configs,
        opts,
        lambda tokenizer, as_text: make_workload(args, tokenizer, as_text),
        console,
        record_run,
        interleave=args.interleave,
    )
    if not results.runs:
        console.print("[red]no run completed")
        return 1
    console.print(f"results: {output}")
    latencies = [float(x) for x in args.at_latency.split(",") if x.strip()]
    print_report(results.runs, latencies, console)
    if not args.no_plot:
        from loadtest.figures import write_plots  # matplotlib loads in seconds; only when plotting

        for path in write_plots(results.runs, stem):
            console.print(f"plot: {path}")
    return 1 if failures else 0


def _log_path(args: argparse.Namespace, stem: Path, label: str) -> Path:
    name = f"{stem.name}-server-{_slug(label)}.log"
    return args.log_dir / name if args.log_dir else stem.with_name(name)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_") or "server"
