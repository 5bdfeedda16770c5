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
from loadtest.results import BenchmarkResults


class Named(Protocol):
    @property
    def name(self) -> str: ...


S = TypeVar("S", bound=Named)


def add_run_args(p: argparse.ArgumentParser, output_dir: Path) -> None:
    """The flags every head-to-head script takes: how long each scenario runs, its seed, where results go."""
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per server and scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=output_dir)


def closed_loop_args(
    workload: list[str],
    concurrency: int,
    a: argparse.Namespace,
    servers: list[tuple[str, str]],
    out: Path,
) -> list[str]:
    """`python -m loadtest` flags for one scenario: `workload`'s flags at `concurrency` for a.duration
    seconds (a.seed), each (label, launch command) of `servers` measured in turn."""
    launches = [flag for label, command in servers for flag in ("--launch", command, "--label", label)]
    return [
        "--endpoint", "chat", *workload,
        "--request-rates", "inf", "--max-concurrency", str(concurrency), "--duration", str(a.duration),
        "--warmup-requests", str(max(2, concurrency)), "--seed", str(a.seed), "--temperature", "0",
        "--interleave", "--launch-timeout", "600", "--no-plot", "--no-progress",
        *launches, "--output", str(out),
    ]  # fmt: skip


def run_scenarios(
    scenarios: Sequence[S],
    duration: float,
    args_of: Callable[[S, Path], list[str]],
    out_of: Callable[[S], Path],
) -> list[tuple[S, BenchmarkResults | None]]:
    """Run each scenario's load test; None where it failed (the table shows a dash, the run goes on)."""
    rows: list[tuple[S, BenchmarkResults | None]] = []
    for s in scenarios:
        out = out_of(s)
        print(f"== {s.name}: {duration:g} s per server", flush=True)
        rc = cli.main(args_of(s, out))
        rows.append((s, BenchmarkResults.load(out) if rc == 0 and out.is_file() else None))
    return rows


def publish(report: str, path: Path) -> None:
    """Write the report beside the raw results and print it."""
    path.write_text(report + "\n")
    print(report)
