"""Two servers measured in turn with the same requests, scenario by scenario: what `loadtest.peers`
(orca-serve against llama-server) and `loadtest.speculation` (speculation on against off) share.

Each scenario is one `python -m loadtest --interleave` run, closed loop at one concurrency, greedy and
streamed over the chat endpoint, so drift in a shared machine's load falls on both servers alike."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from loadtest import cli
from loadtest.results import BenchmarkResults, isa_text


class Named(Protocol):
    @property
    def name(self) -> str: ...


S = TypeVar("S", bound=Named)
F = TypeVar("F")  # one server's figures in one scenario

# `python -m loadtest`'s 600 s cut off llama-server's requests at 32 streams of Llama-3.1-8B on two cores
# (TTFT ~4 min, then 64-128 tokens at ~4 s): its figures then counted the 11 of 32 that completed.
REQUEST_TIMEOUT_S = 3600.0


def add_run_args(p: argparse.ArgumentParser, output_dir: Path) -> None:
    """The flags every head-to-head script takes: how long each scenario runs, its seed, where results go,
    and whether outputs have exact lengths."""
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per server and scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slices",
        type=int,
        default=1,
        help="each scenario in this many alternating turns per server, pooled (`python -m loadtest --slices`)",
    )
    p.add_argument("--output-dir", type=Path, default=output_dir)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exact output lengths (the default); --no-ignore-eos: outputs end at the model's end of turn",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help="seconds a request may take before it counts as failed (a guard against a hung server, not a "
        "latency bound: 32 streams of an 8B model on two cores take over ten minutes a request)",
    )


def closed_loop_args(
    workload: list[str],
    concurrency: int,
    a: argparse.Namespace,
    servers: list[tuple[str, str]],
    out: Path,
) -> list[str]:
    """`python -m loadtest` flags for one scenario: `workload`'s flags at `concurrency` for a.duration
    seconds (a.seed, a.ignore_eos), each (label, launch command) of `servers` measured in turn."""
    launches = [flag for label, command in servers for flag in ("--launch", command, "--label", label)]
    return [
        "--endpoint", "chat", *workload, "--ignore-eos" if a.ignore_eos else "--no-ignore-eos",
        "--request-rates", "inf", "--max-concurrency", str(concurrency), "--duration", str(a.duration),
        "--warmup-requests", str(max(2, concurrency)), "--seed", str(a.seed), "--temperature", "0",
        "--slices", str(a.slices), "--request-timeout", str(a.request_timeout),
        "--interleave", "--launch-timeout", "600", "--no-plot", "--no-progress",
        *launches, "--output", str(out),
    ]  # fmt: skip


def scenario_table(
    header: str,
    rows: Sequence[tuple[S, dict[str, F]]],
    labels: tuple[str, str],
    line: Callable[[S, F, F], str],
    missing: Callable[[S], str],
) -> str:
    """Markdown: `header` (its column names and alignment rows), then a line per scenario out of both
    servers' figures (`labels`' order), or `missing(s)` where either server's run failed."""
    lines = [header]
    for s, f in rows:
        first, second = f.get(labels[0]), f.get(labels[1])
        lines.append(missing(s) if first is None or second is None else line(s, first, second))
    return "\n".join(lines)


def run_and_publish(
    scenarios: Sequence[S],
    a: argparse.Namespace,
    args_of: Callable[[S, Path], list[str]],
    file_of: Callable[[S], str],
    figures_of: Callable[[BenchmarkResults], dict[str, F]],
    table_of: Callable[[list[tuple[S, dict[str, F]]]], str],
    intro: str,
    report_name: str,
) -> None:
    """Run each scenario's load test for a.duration seconds a server, its results in a.output_dir under
    `file_of(s)`; read each server's figures from them ({} where it failed: the table shows dashes, the
    run goes on); then write the report (`intro`, the CPU's ISA, `table_of` the rows) there as
    `report_name` and print it."""
    a.output_dir.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[S, dict[str, F]]] = []
    notes: list[str] = []
    for s in scenarios:
        out = a.output_dir / file_of(s)
        print(f"== {s.name}: {a.duration:g} s per server", flush=True)
        rc = cli.main(args_of(s, out))
        if rc == 0 and out.is_file():
            results = BenchmarkResults.load(out)
            rows.append((s, figures_of(results)))
            notes += failure_notes(s.name, results)
        else:
            rows.append((s, {}))
    footnotes = "".join(f"\n\n{n}" for n in notes)
    publish(f"{intro} CPU ISA: {isa_text()}.\n\n{table_of(rows)}{footnotes}", a.output_dir / report_name)


def failure_notes(scenario: str, results: BenchmarkResults) -> list[str]:
    """A line for each server whose requests failed in a scenario: its figures count only the requests
    that completed, so a row with failures is not a like-for-like ratio and must say so."""
    notes = []
    for run in results.runs:
        s = run.summary
        failed = sum(s.errors.values())
        if failed:
            kinds = ", ".join(f"{kind} {n}" for kind, n in s.errors.items())
            notes.append(
                f"**{scenario}, {run.label}: {failed} of {s.num_requests} requests failed ({kinds})**; "
                "its figures count only the completed ones (a timeout: raise --request-timeout)."
            )
    return notes


def publish(report: str, path: Path) -> None:
    """Write the report beside the raw results and print it."""
    path.write_text(report + "\n")
    print(report)
