"""PNG figures of a sweep: the paper's throughput/latency curve, and CDFs of TTFT and TPOT."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from loadtest import metrics  # noqa: E402
from loadtest.results import RunResult, format_rate  # noqa: E402


def _latency_panel(ax: plt.Axes, runs: Sequence[RunResult], x: str) -> None:
    """One curve per configuration: x is achieved throughput or offered rate; y the median ms/token."""
    top_x, top_y = 0.0, 0.0
    by_label: dict[str, list[RunResult]] = {}
    for run in sorted(runs, key=lambda r: r.rate):
        by_label.setdefault(run.label, []).append(run)
    for label, label_runs in by_label.items():
        pts = [
            (
                r.summary.request_throughput if x == "throughput" else r.rate,
                r.summary.normalized_latency_ms.p50,
                r.rate,
            )
            for r in label_runs
            if not math.isnan(r.summary.normalized_latency_ms.p50)
            and math.isfinite(r.rate if x == "rate" else 0.0)
        ]
        if not pts:
            continue
        xs, ys, _ = zip(*pts, strict=True)
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        if x == "throughput":
            # The offered rate beside each point: achieved throughput falls short of it under overload.
            for px, py, rate in pts:
                ax.annotate(
                    format_rate(rate),
                    (px, py),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line.get_color(),
                )
        top_x, top_y = max(top_x, *xs), max(top_y, *ys)
    ax.set_xlabel("request throughput (req/s)" if x == "throughput" else "offered request rate (req/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.grid(True, alpha=0.3)
    # From zero, as in the paper, with headroom so the top points are not cut by the frame.
    ax.set_xlim(0, top_x * 1.1 or 1.0)
    ax.set_ylim(0, top_y * 1.15 or 1.0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_throughput_latency(runs: Sequence[RunResult], path: Path, title: str | None = None) -> Path:
    """Median normalized latency (ms/token) against request throughput (the paper's end-to-end
    figures; points labelled with their offered rate) and, beside it, against the offered rate."""
    fig, (ax_thr, ax_rate) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=110)
    _latency_panel(ax_thr, runs, "throughput")
    _latency_panel(ax_rate, runs, "rate")
    ax_thr.set_title("against achieved throughput (labels: offered rate)", fontsize=9)
    ax_rate.set_title("against offered rate", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label)


def plot_cdfs(runs: Sequence[RunResult], path: Path) -> Path:
    """CDFs of TTFT and TPOT (ms): one row per offered rate, one curve per configuration."""
    rates = sorted({r.rate for r in runs})
    fig, axes = plt.subplots(len(rates), 2, figsize=(9, 2.8 * len(rates)), dpi=110, squeeze=False)
    for row, rate in enumerate(rates):
        ax_ttft, ax_tpot = axes[row]
        for run in (r for r in runs if r.rate == rate):
            done = [rec for rec in run.records if rec.ok]
            ttfts = [v * 1000.0 for v in map(metrics.ttft, done) if v is not None]
            tpots = [v * 1000.0 for v in map(metrics.tpot, done) if v is not None]
            _cdf(ax_ttft, ttfts, run.label)
            _cdf(ax_tpot, tpots, run.label)
        for ax, name in ((ax_ttft, "TTFT"), (ax_tpot, "TPOT")):
            ax.set_title(f"{name} CDF at {format_rate(rate)} req/s", fontsize=9)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[RunResult], stem: Path) -> list[Path]:
    """`<stem>-throughput-latency.png` and `<stem>-cdf.png`; returns the paths."""
    return [
        plot_throughput_latency(runs, stem.with_name(stem.name + "-throughput-latency.png")),
        plot_cdfs(runs, stem.with_name(stem.name + "-cdf.png")),
    ]
