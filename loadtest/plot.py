"""`python -m loadtest.plot results*.json`: figures and the equal-latency comparison from results files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from loadtest.figures import write_plots
from loadtest.report import print_report
from loadtest.results import BenchmarkResults, RunResult


def load_runs(paths: Sequence[Path]) -> list[RunResult]:
    """All runs of several files; a label seen in two files is prefixed with its file's name."""
    per_file = [(p, BenchmarkResults.load(p).runs) for p in paths]
    seen: dict[str, Path] = {}
    clash: set[str] = set()
    for path, runs in per_file:
        for label in {r.label for r in runs}:
            if label in seen and seen[label] != path:
                clash.add(label)
            seen.setdefault(label, path)
    out: list[RunResult] = []
    for path, runs in per_file:
        for run in runs:
            if run.label in clash:
                run.label = f"{path.stem}:{run.label}"
            out.append(run)
    return out


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.plot", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files from python -m loadtest")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="path stem of the PNGs (default: the first results file without .json)",
    )
    parser.add_argument(
        "--at-latency",
        type=parse_floats,
        default=[],
        help="median normalized latency bounds (ms/token, comma-separated) at which to compare throughput",
    )
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    stem = args.out or args.results[0].with_suffix("")
    for path in write_plots(runs, stem):
        print(f"wrote {path}")
    print_report(runs, args.at_latency)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
