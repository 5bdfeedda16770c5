"""`python -m loadtest.multiturn`: chat conversations of K turns, each turn resending the whole history,
against one or more servers in turn; time to first token per turn (what prefix caching is for).

    python -m loadtest.multiturn --num-conversations 8 --turns 5 --system-len 1000 \\
        --launch "python -m server --model default" --label caching \\
        --launch "python -m server --model default --no-enable-prefix-caching" --label no-caching

Without --launch it measures the server at --base-url. Every configuration gets the same conversations
(system prompt, user messages, think times); the assistant's replies are each server's own (greedy,
exactly --output-len tokens). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.cli import auto_labels, parse_server_args, server_parser
from loadtest.client import Target, send_request
from loadtest.conversation import (
    ConversationShape,
    TurnRecord,
    make_conversation,
    run_conversations,
)
from loadtest.launcher import LaunchedServer
from loadtest.metrics import Distribution, distribution, ttft
from loadtest.prompts import PromptBuilder
from loadtest.records import RequestRecord
from loadtest.report import make_console
from loadtest.results import machine_info
from loadtest.runner import make_client
from loadtest.server_metrics import counter_deltas, scrape
from loadtest.sweep import CONFIG_ERRORS, pick_model, redact
from loadtest.tokenizer import resolve_tokenizer
from loadtest.workload import RequestSpec


@dataclass
class TurnSummary:
    turn: int
    requests: int
    ok: int
    prompt_tokens: float  # mean of what the server reported
    cached_tokens: float | None  # mean, when the server reports usage.prompt_tokens_details
    ttft_ms: Distribution


@dataclass
class ConfigResult:
    label: str
    command: str | None
    model: str
    turns: list[TurnSummary]
    ttft_later_ms: Distribution  # turns 2 and later, pooled: the turns that resend a history
    ttft_first_ms: Distribution
    duration_s: float
    server: dict[str, float] = field(default_factory=dict)  # counter deltas from /metrics
    records: list[TurnRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["turns"] = [{**asdict(t), "ttft_ms": t.ttft_ms.to_dict()} for t in self.turns]
        out["ttft_later_ms"] = self.ttft_later_ms.to_dict()
        out["ttft_first_ms"] = self.ttft_first_ms.to_dict()
        out["records"] = [r.to_dict() for r in self.records]
        return out


def summarize_turns(records: Sequence[TurnRecord], num_turns: int) -> list[TurnSummary]:
    out = []
    for k in range(1, num_turns + 1):
        turn = [t.record for t in records if t.turn == k]
        ok = [r for r in turn if r.ok]
        cached = [r.cached_tokens_reported for r in ok if r.cached_tokens_reported is not None]
        out.append(
            TurnSummary(
                turn=k,
                requests=len(turn),
                ok=len(ok),
                prompt_tokens=_mean([r.prompt_len for r in ok]),
                cached_tokens=_mean(cached) if cached else None,
                ttft_ms=distribution(_ttfts(ok), scale=1000.0),
            )
        )
    return out


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [v for v in (ttft(r) for r in records) if v is not None]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def result_of(
    label: str, command: str | None, model: str, records: list[TurnRecord], turns: int
) -> ConfigResult:
    later = [t.record for t in records if t.turn >= 2]
    first = [t.record for t in records if t.turn == 1]
    ends = [t.record.end_time for t in records if t.record.end_time is not None]
    return ConfigResult(
        label=label,
        command=redact(command),
        model=model,
        turns=summarize_turns(records, turns),
        ttft_later_ms=distribution(_ttfts(later), scale=1000.0),
        ttft_first_ms=distribution(_ttfts(first), scale=1000.0),
        duration_s=max(ends) if ends else math.nan,
        records=records,
    )


# ---- running ---------------------------------------------------------------------------------------


async def measure(
    base_url: str, args: argparse.Namespace, console: Console, label: str, command: str | None
) -> ConfigResult:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Blocking HTTP: off the event loop (which may be the one serving base_url, in tests).
    model, root = await asyncio.to_thread(pick_model, args.model, base_url, headers)
    tokenizer = await asyncio.to_thread(
        resolve_tokenizer, args.tokenizer, base_url, model, headers, hint=root
    )
    builder = PromptBuilder(tokenizer)
    shape = shape_of(args)
    conversations = [make_conversation(builder, shape, args.seed, i) for i in range(args.num_conversations)]
    target = Target(base_url, model, "chat", args.temperature, args.request_timeout)
    console.print(f"[bold]{label}[/]: model {model}, tokenizer {tokenizer.description}")
    async with make_client(base_url, args.api_key, args.request_timeout) as client:
        await warm_up(client, target, builder, args)
        before = await scrape(client)
        done = [0]

        def on_turn(turn: TurnRecord) -> None:
            done[0] += 1
            if not turn.record.ok:
                console.print(
                    f"[red]{label}: conversation {turn.conversation} turn {turn.turn}: {turn.record.error}"
                )

        records = await run_conversations(client, target, conversations, shape, args.start_spread, on_turn)
        after = await scrape(client)
    result = result_of(label, command, model, records, shape.turns)
    result.server = counter_deltas(before, after)
    return result


async def warm_up(client: Any, target: Target, builder: PromptBuilder, args: argparse.Namespace) -> None:
    """Short chats on texts unrelated to the conversations (first-call costs; nothing they share)."""
    import numpy as np

    for k in range(args.warmup_requests):
        text = builder.text_prompt(32, np.random.default_rng([args.seed, 10_000_000 + k]))
        spec = RequestSpec(-1, text, 32, 8)
        await send_request(client, target, spec, RequestRecord(-1, 32, 8, 0.0), 0.0)


def shape_of(args: argparse.Namespace) -> ConversationShape:
    return ConversationShape(args.turns, args.system_len, args.user_len, args.output_len, args.think_time)


def run_config(args: argparse.Namespace, console: Console, label: str, command: str | None) -> ConfigResult:
    if command is None:
        return asyncio.run(measure(args.base_url, args, console, label, None))
    name = f"{args.output.stem}-server-{_slug(label)}.log"
    log = args.log_dir / name if args.log_dir else args.output.with_name(name)
    server = LaunchedServer(command, log, health_timeout=args.launch_timeout)
    console.print(f"[bold]{label}[/]: starting {' '.join(server.argv)} (log: {log})")
    server.start()
    try:
        return asyncio.run(measure(server.base_url, args, console, label, command))
    finally:
        server.stop()


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_") or "server"


# ---- report ----------------------------------------------------------------------------------------


def report_table(results: Sequence[ConfigResult]) -> Table:
    table = Table(title="TTFT per turn (ms)")
    for col in ("config", "turn", "ok", "prompt tok", "cached tok", "TTFT p50", "TTFT p90"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for res in results:
        for t in res.turns:
            cached = "-" if t.cached_tokens is None else f"{t.cached_tokens:.0f}"
            table.add_row(
                res.label,
                str(t.turn),
                f"{t.ok}/{t.requests}",
                f"{t.prompt_tokens:.0f}",
                cached,
                f"{t.ttft_ms.p50:.0f}",
                f"{t.ttft_ms.p90:.0f}",
            )
    return table


def comparison_lines(results: Sequence[ConfigResult]) -> list[str]:
    """TTFT p50 of turns >= 2 per configuration, and each against the others."""
    lines = []
    for res in results:
        server = res.server
        hits = ""
        if server.get("prefix_cache_queries"):
            hits = f", server prefix-cache hit rate {server['prefix_cache_hits'] / server['prefix_cache_queries']:.1%}"
        lines.append(
            f"{res.label}: TTFT p50 turn 1 {res.ttft_first_ms.p50:.0f} ms, turns >= 2 {res.ttft_later_ms.p50:.0f} ms "
            f"(p90 {res.ttft_later_ms.p90:.0f} ms){hits}"
        )
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            ratio = b.ttft_later_ms.p50 / a.ttft_later_ms.p50 if a.ttft_later_ms.p50 else math.nan
            lines.append(f"TTFT p50 turns >= 2: {b.label} / {a.label} = {ratio:.2f}")
    return lines


# ---- the command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p, g = server_parser("python -m loadtest.multiturn", __doc__)
    g.add_argument("--tokenizer", default=None, help="as in python -m loadtest (default: the model's)")

    d = ConversationShape()
    g = p.add_argument_group("conversations")
    g.add_argument("--num-conversations", type=int, default=8, help="held at once, one client each")
    g.add_argument("--turns", type=int, default=d.turns)
    g.add_argument("--system-len", type=int, default=d.system_len, help="tokens of the system prompt")
    g.add_argument("--user-len", type=int, default=d.user_len, help="tokens of each user message")
    g.add_argument("--output-len", type=int, default=d.output_len, help="tokens of each reply")
    g.add_argument("--think-time", type=float, default=d.think_time, help="mean seconds between turns")
    g.add_argument(
        "--start-spread", type=float, default=2.0, help="conversation i starts at i/n of this many seconds"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--output", type=Path, default=None, help="results JSON (default loadtest-results/...)")
    g.add_argument(
        "--log-dir", type=Path, default=None, help="launched servers' logs (default: beside --output)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_server_args(parser, argv)
    if args.num_conversations < 1:
        parser.error("--num-conversations must be >= 1")
    try:
        shape_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    started = dt.datetime.now(dt.timezone.utc)
    args.output = args.output or Path("loadtest-results") / f"multiturn-{started:%Y%m%dT%H%M%SZ}.json"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    console = make_console()
    if args.launch:
        configs = list(zip(args.label or auto_labels(args.launch), args.launch, strict=True))
    else:
        configs = [(args.label[0] if args.label else "server", None)]
    results: list[ConfigResult] = []
    failures = 0
    for label, command in configs:
        try:
            results.append(run_config(args, console, label, command))
        except CONFIG_ERRORS as exc:
            failures += 1
            console.print(f"[red]{label}: {exc}")
            continue
        save(args, argv, started, results)
    if not results:
        return 1
    console.print(report_table(results))
    for line in comparison_lines(results):
        console.print(line)
    console.print(f"results: {args.output}")
    return 1 if failures or any(t.ok < t.requests for r in results for t in r.turns) else 0


def save(
    args: argparse.Namespace, argv: Sequence[str] | None, started: dt.datetime, results: list[ConfigResult]
) -> None:
    config = {
        "argv": redact(list(sys.argv[1:] if argv is None else argv)),
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "shape": asdict(shape_of(args)),
        "num_conversations": args.num_conversations,
    }
    data = {"config": config, "results": [r.to_dict() for r in results]}
    args.output.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
