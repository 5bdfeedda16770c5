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


def _server_cell(counters: dict[str, float]) -> str:
    if not counters:
        return "-"
    parts = [f"{counters.get('steps', 0):.0f} steps"]
    if "tokens_per_step" in counters:
        parts.append(f"{counters['tokens_per_step']:.1f} tok/step")
    parts.append(f"{counters.get('preemptions', 0):.0f} preempted")
    return ", ".join(parts)


def summary_table(runs: Sequence[RunResult], title: str = "orca-serve load test") -> Table:
    table = Table(title=title, show_lines=False)
    with_server = any(run.summary.extras.get("server") for run in runs)
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
    if with_server:
        table.add_column("server counters", justify="left")
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
            *([_server_cell(s.extras.get("server") or {})] if with_server else []),
        )
    return table


def curves(runs: Sequence[RunResult], x: str = "throughput") -> dict[str, list[tuple[float, float]]]:
    """Per configuration, by rate: (x, median normalized latency in ms/token).

    x is the achieved request throughput (the paper's axis) or the offered request `rate`.
    """
    out: dict[str, list[tuple[float, float]]] = {}
    for run in sorted(runs, key=lambda r: r.rate):
        load = run.summary.request_throughput if x == "throughput" else run.rate
        out.setdefault(run.label, []).append((load, run.summary.normalized_latency_ms.p50))
    return out


def default_latency_bounds(runs: Sequence[RunResult]) -> list[float]:
    """Latencies at which to compare configurations when none are given.

    Twice the highest light-load latency of any configuration (its latency at its lowest offered
    rate, or at its lowest achieved throughput if higher): every configuration starts under it, and
    it is loose enough that the faster ones show how far they scale under it.
    """
    floors = []
    for x in ("rate", "throughput"):
        for pts in curves(runs, x).values():
            finite = sorted(p for p in pts if math.isfinite(p[0]) and not math.isnan(p[1]))
            if finite:
                floors.append(finite[0][1])
    return [2.0 * max(floors)] if floors else []


def capacity_table(runs: Sequence[RunResult], latencies_ms: Sequence[float]) -> Table:
    """The load each configuration sustains under median normalized latency bounds.

    Both as offered request rate (what "serves N times the request rate" means; finite rates only)
    and as achieved throughput (the paper's x axis). In short runs the achieved throughput at high
    rates is held down by the drain after the last arrival, more so for slower configurations.
    """
    by_rate, by_throughput = curves(runs, "rate"), curves(runs, "throughput")
    labels = list(by_rate)
    table = Table(
        title="Load sustained under a median normalized latency bound (req/s)",
        caption="'>=': no measured load reached the bound (a lower bound); (Nx): ratio to the last column",
    )
    table.add_column("bound\nms/token", justify="right")
    table.add_column("load", justify="left")
    for label in labels:
        table.add_column(label, justify="right")
    for bound in latencies_ms:
        for name, per_label in (("offered rate", by_rate), ("throughput", by_throughput)):
            caps = [capacity_at_latency(per_label[label], bound) for label in labels]
            base = caps[-1]
            cells = []
            for cap in caps:
                if cap is None:
                    cells.append("above bound")
                    continue
                cell = f"{'' if cap.crossed else '>='}{cap.load:.2f}"
                if base is not None and base.load > 0:
                    cell += f" ({cap.load / base.load:.1f}x)"
                cells.append(cell)
            table.add_row(f"{bound:.1f}", name, *cells)
    return table


def print_report(
    runs: Sequence[RunResult], latencies_ms: Sequence[float] = (), console: Console | None = None
) -> None:
    console = console or make_console()
    console.print(summary_table(runs))
    if len(curves(runs)) > 1:
        console.print(capacity_table(runs, list(latencies_ms) or default_latency_bounds(runs)))
