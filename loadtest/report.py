"""Terminal output: the summary table of a sweep and the throughput comparison at equal latency."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from loadtest.metrics import capacity_at_latency
from loadtest.results import RunResult, format_rate


def make_console() -> Console:
    console = Console()
    # Logs and pipes get rich's 80 columns, which squeezes the wide tables unreadable.
    return console if console.is_terminal else Console(width=200)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def summary_table(runs: Sequence[RunResult], title: str = "orca-serve load test") -> Table:
    table = Table(title=title, show_lines=False)
    for name, justify in (
        ("config", "left"),
        ("rate", "right"),
        ("done", "right"),
        ("req/s", "right"),
        ("out tok/s", "right"),
        ("norm lat p50\nms/token", "right"),
        ("TTFT p50/p99\nms", "right"),
        ("TPOT p50/p99\nms", "right"),
        ("ITL p50/p99\nms", "right"),
        ("E2E p50/p99\nms", "right"),
        ("goodput\nreq/s", "right"),
        ("errors", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for run in runs:
        s = run.summary
        errors = ", ".join(f"{k}:{v}" for k, v in s.errors.items()) or "-"
        if s.short_outputs:
            errors += f" (short outputs: {s.short_outputs})"
        table.add_row(
            run.label,
            format_rate(run.rate),
            f"{s.completed}/{s.num_requests}",
            f"{s.request_throughput:.2f}",
            f"{s.output_token_throughput:.1f}",
            _ms(s.normalized_latency_ms.p50),
            f"{_ms(s.ttft_ms.p50)} / {_ms(s.ttft_ms.p99)}",
            f"{_ms(s.tpot_ms.p50)} / {_ms(s.tpot_ms.p99)}",
            f"{_ms(s.itl_ms.p50)} / {_ms(s.itl_ms.p99)}",
            f"{_ms(s.e2el_ms.p50)} / {_ms(s.e2el_ms.p99)}",
            "-" if s.goodput is None else f"{s.goodput:.2f}",
            errors,
        )
    return table


def curves(runs: Sequence[RunResult]) -> dict[str, list[tuple[float, float]]]:
    """Per configuration: (request throughput, median normalized latency in ms/token), by rate."""
    out: dict[str, list[tuple[float, float]]] = {}
    for run in sorted(runs, key=lambda r: r.rate):
        out.setdefault(run.label, []).append(
            (run.summary.request_throughput, run.summary.normalized_latency_ms.p50)
        )
    return out


def default_latency_bounds(runs: Sequence[RunResult]) -> list[float]:
    """Latencies at which to compare configurations when none are given.

    Twice the slowest configuration's lowest median normalized latency: a bound every configuration
    can meet at light load, loose enough that the faster ones show how far they scale under it.
    """
    floors = [min(lat for _, lat in pts) for pts in curves(runs).values() if pts]
    floors = [f for f in floors if not math.isnan(f)]
    return [2.0 * max(floors)] if floors else []


def capacity_table(runs: Sequence[RunResult], latencies_ms: Sequence[float]) -> Table:
    """Highest request throughput of each configuration at a median normalized latency bound."""
    per_label = curves(runs)
    table = Table(
        title="Request throughput (req/s) under a median normalized latency bound",
        caption="'>=': no rate reached the bound, so a lower bound; (Nx): ratio to the last column",
    )
    table.add_column("latency bound\nms/token", justify="right")
    labels = list(per_label)
    for label in labels:
        table.add_column(label, justify="right")
    for bound in latencies_ms:
        caps = [capacity_at_latency(per_label[label], bound) for label in labels]
        base = caps[-1]
        cells = []
        for cap in caps:
            if cap is None:
                cells.append("above bound")
                continue
            cell = f"{'' if cap.crossed else '>='}{cap.throughput:.2f}"
            if base is not None and base.throughput > 0:
                cell += f" ({cap.throughput / base.throughput:.1f}x)"
            cells.append(cell)
        table.add_row(f"{bound:.1f}", *cells)
    return table


def print_report(
    runs: Sequence[RunResult], latencies_ms: Sequence[float] = (), console: Console | None = None
) -> None:
    console = console or make_console()
    console.print(summary_table(runs))
    if len(curves(runs)) > 1:
        console.print(capacity_table(runs, list(latencies_ms) or default_latency_bounds(runs)))
