"""`python -m loadtest.paper`: ORCA's experiment on the real engine, over HTTP, in one command.

    python -m loadtest.paper [--shape llama-3.2-1b | --model PATH] [--request-rates 0.5,1,2,4,6]
                             [--num-requests 60] [--output-dir docs/benchmarks/paper]
    make bench-paper

The paper's figure: median normalized latency (end-to-end latency over output tokens) against request
throughput, iteration-level scheduling (ORCA: requests join and leave the batch at every step) against
request-level scheduling (the Triton + FasterTransformer baseline: a batch runs until its longest request
is done), and the load each sustains at the same latency. Here with speculative decoding off and on for
both (n-gram prompt lookup, the server's default), so four servers on the same GGUF, all started at once
and measured in turn at each Poisson rate with the same requests (`python -m loadtest --interleave`:
drift in a shared machine's load falls on all of them alike).

The model is a random-weight Q4_K_M GGUF at a published shape (loadtest/gguf_shapes.py; Llama-3.2-1B by
default), the lengths the paper's trace at a CPU's scale (prompts 32-128 tokens, outputs 1-32). Writes
`paper.json` (every request), the two plots beside it and `paper.md` (the tables docs/benchmarks.md
quotes) into --output-dir.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest import cli
from loadtest.cli import doc_parser
from loadtest.head_to_head import publish
from loadtest.metrics import capacity_at_latency
from loadtest.report import curves, default_latency_bounds
from loadtest.results import BenchmarkResults, RunResult, isa_text

REPO = Path(__file__).resolve().parent.parent
# (label, flags added to every server's command): the paper's two schedulers, speculation off and on.
CONFIGS = (
    ("iteration", "--scheduling iteration --speculative off"),
    ("request", "--scheduling request --speculative off"),
    ("iteration+spec", "--scheduling iteration"),
    ("request+spec", "--scheduling request"),
)
PAIRS = (("iteration", "request"), ("iteration+spec", "request+spec"))


def server_commands(model: Path, extra: str) -> list[tuple[str, str]]:
    base = f"{shlex.quote(sys.executable)} -m server --model {shlex.quote(str(model))} {extra}".strip()
    return [(label, f"{base} {flags}") for label, flags in CONFIGS]


def loadtest_args(a: argparse.Namespace, servers: list[tuple[str, str]], out: Path) -> list[str]:
    launches = [flag for label, command in servers for flag in ("--launch", command, "--label", label)]
    return [
        "--endpoint", "completions", "--workload", "orca",
        "--input-len-min", str(a.input_len_min), "--input-len-max", str(a.input_len_max),
        "--output-len-min", str(a.output_len_min), "--output-len-max", str(a.output_len_max),
        "--request-rates", a.request_rates, "--num-requests", str(a.num_requests), "--seed", str(a.seed),
        "--warmup-requests", "2", "--interleave", "--launch-timeout", "900", "--no-progress",
        *launches, "--output", str(out),
    ]  # fmt: skip


def latency_table(runs: Sequence[RunResult]) -> str:
    """Per offered rate and configuration: median normalized latency, achieved throughput, TTFT p50."""
    labels = list(dict.fromkeys(r.label for r in runs))
    by = {(r.label, r.rate): r.summary for r in runs}
    lines = ["| offered rate (req/s) | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for rate in sorted({r.rate for r in runs}):
        cells = []
        for label in labels:
            s = by.get((label, rate))
            cells.append(
                "-"
                if s is None
                else f"{s.normalized_latency_ms.p50:.1f} ms, {s.request_throughput:.2f} req/s, "
                f"TTFT {s.ttft_ms.p50:.0f} ms"
            )
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capacity_table(runs: Sequence[RunResult], bounds: Sequence[float]) -> str:
    """The offered rate each configuration sustains under each latency bound, and iteration-level over
    request-level scheduling at the same bound, speculation off and on."""
    per = curves(runs, "rate")
    labels = list(per)
    head = (
        "| bound (ms/token) | "
        + " | ".join(labels)
        + " | "
        + " | ".join(f"{i} / {r}" for i, r in PAIRS)
        + " |"
    )
    lines = [head, "|---" * (1 + len(labels) + len(PAIRS)) + "|"]
    for bound in bounds:
        caps = {label: capacity_at_latency(per[label], bound) for label in labels}
        cells = ["above" if c is None else f"{'' if c.crossed else '≥ '}{c.load:.2f}" for c in caps.values()]
        for i, r in PAIRS:
            ci, cr = caps.get(i), caps.get(r)
            if ci is None or cr is None or cr.load <= 0:
                cells.append("-")
            else:
                cells.append(f"**{'' if ci.crossed else '≥ '}{ci.load / cr.load:.1f}x**")
        lines.append(f"| {bound:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: BenchmarkResults, model: Path, bounds: Sequence[float]) -> str:
    runs = results.runs
    return (
        f"Four servers on {model.name}, measured in turn at each rate with the same requests. CPU ISA: "
        f"{isa_text()}.\n\nMedian normalized latency, achieved throughput and TTFT "
        f"p50 per offered rate:\n\n{latency_table(runs)}\n\nOffered rate sustained under a median "
        f"normalized latency bound (req/s; ≥: no measured rate reached the bound):\n\n"
        f"{capacity_table(runs, bounds)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = doc_parser("python -m loadtest.paper", __doc__)
    p.add_argument(
        "--shape", default="llama-3.2-1b", help="a loadtest.gguf_shapes shape (default llama-3.2-1b)"
    )
    p.add_argument(
        "--model", type=Path, default=None, help="a model (GGUF file, HF directory) instead of --shape's"
    )
    p.add_argument("--server-args", default="", help="more flags for every `python -m server`")
    p.add_argument("--request-rates", default="0.5,1,2,4,6", help="Poisson rates, comma-separated")
    p.add_argument("--num-requests", type=int, default=60, help="per rate and server")
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=128)
    p.add_argument("--output-len-min", type=int, default=1)
    p.add_argument("--output-len-max", type=int, default=32)
    p.add_argument("--at-latency", default="", help="bounds (ms/token); default: from the lightest loads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=REPO / "docs" / "benchmarks" / "paper")
    a = p.parse_args(argv)
    if a.model is None:
        from loadtest.gguf_shapes import SHAPES, default_path, write_gguf

        a.model = default_path(a.shape, is_tiny=False)
        if not a.model.is_file():
            print(f"writing {a.model} ({a.shape}, random Q4_K_M weights)", flush=True)
            write_gguf(SHAPES[a.shape], a.model, name=a.shape)
    a.output_dir.mkdir(parents=True, exist_ok=True)
    out = a.output_dir / "paper.json"
    rc = cli.main(loadtest_args(a, server_commands(a.model, a.server_args), out))
    if rc != 0 or not out.is_file():
        return rc or 1
    results = BenchmarkResults.load(out)
    # By default three bounds around twice the slowest configuration's lightest-load latency.
    bounds = [float(x) for x in a.at_latency.split(",") if x.strip()] or [
        k * b for b in default_latency_bounds(results.runs) for k in (0.75, 1.0, 1.5)
    ]
    publish(report(results, a.model, bounds), a.output_dir / "paper.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
