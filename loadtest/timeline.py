"""`python -m loadtest.timeline results.json`: what iterations cost, read from client timelines alone.

For a server that streams one token per request per iteration, each gap between two tokens of a
request spans one iteration. Counting, for every gap, how many requests were streaming through it
(the decode batch) and whether another request's first token landed in it (its prefill ran in that
iteration) gives the server's iteration time by batch size, with and without a prefill in the step,
without any access to the server. That is the evidence for *why* a configuration is fast or slow:
e.g. an engine whose decode step costs twice as much for two requests as for one gains nothing from
batching, and every prefill mixed into a step stalls the running decodes.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from loadtest.records import RequestRecord
from loadtest.report import make_console
from loadtest.results import BenchmarkResults, format_rate


@dataclass(frozen=True)
class Gap:
    seconds: float
    decoding: int  # requests streaming through the whole gap (the gap's own request included)
    prefill_tokens: int  # prompt tokens of requests whose first token landed in the gap


def token_gaps(records: Sequence[RequestRecord]) -> list[Gap]:
    done = [r for r in records if r.ok and r.end_time is not None and r.first_token_time is not None]
    gaps: list[Gap] = []
    for rec in done:
        for t0, t1 in zip(rec.token_times, rec.token_times[1:], strict=False):
            decoding = sum(1 for o in done if o.first_token_time <= t0 and o.end_time >= t1)  # type: ignore[operator]
            prefill = sum(o.prompt_len for o in done if o is not rec and t0 < o.first_token_time <= t1)  # type: ignore[operator]
            gaps.append(Gap(t1 - t0, decoding, prefill))
    return gaps


def gap_table(gaps: Sequence[Gap], title: str) -> Table:
    """Median gap (ms) by decode batch, for steps with and without another request's prefill."""
    table = Table(title=title)
    # Gaps, not steps: a step with n requests streaming shows up as n gaps.
    for name in ("requests decoding", "decode-only gaps", "median ms", "gaps with a prefill", "median ms "):
        table.add_column(name, justify="right")
    for n in sorted({g.decoding for g in gaps}):
        pure = [g.seconds for g in gaps if g.decoding == n and g.prefill_tokens == 0]
        mixed = [g.seconds for g in gaps if g.decoding == n and g.prefill_tokens > 0]
        table.add_row(
            str(n),
            str(len(pure)),
            f"{1000 * statistics.median(pure):.0f}" if pure else "-",
            str(len(mixed)),
            f"{1000 * statistics.median(mixed):.0f}" if mixed else "-",
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.timeline", description=__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--label", default=None, help="only this configuration")
    args = parser.parse_args(argv)
    console = make_console()
    for run in BenchmarkResults.load(args.results).runs:
        if args.label is not None and run.label != args.label:
            continue
        gaps = token_gaps(run.records)
        if not gaps:
            console.print(f"{run.label} @ {format_rate(run.rate)}: no token gaps (the server did not stream)")
            continue
        console.print(
            gap_table(gaps, f"{run.label} @ {format_rate(run.rate)} req/s: token gaps (~ iterations)")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
