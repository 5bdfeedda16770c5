"""`python -m loadtest.speculation`: the server with speculative decoding and without it, in one run.

    python -m loadtest.speculation [--duration 60] [--concurrency 1,32] [--output-dir DIR]
                                   [--server-command "python -m server --model default ..."]

Two servers from the same command, with `--speculative off` and without (the default, auto: n-gram
prompt lookup, or the draft model where the command gives one), are measured in turn with the same requests
(`python -m loadtest --interleave`, so drift in a shared machine's load falls on both alike), closed
loop at each --concurrency, greedy, streamed over the chat endpoint, on two workloads:

- quote: answers that quote their prompts: code edits, fixed texts, quoted passages
  (loadtest/quoting.py), what speculative decoding is for. Its answers end at the model's end of
  turn: past it, a small model invents a new conversation, which quotes nothing, and with exact
  lengths (ignore_eos) that text was most of what the scenario measured. Greedy decoding ends an
  answer at the same token with speculation and without, so both servers still generate the same
  tokens;
- chat: loadtest.peers' decode scenario (64-token prompts cut from the corpus, 64-128 output tokens,
  exact lengths), where proposals are rarely right.

`--ignore-eos` / `--no-ignore-eos` set the lengths of both.

The table gives each scenario's output tok/s off and on, their ratio beside issue #28's target for it
(quote at concurrency 1: 1.8x; chat at 1: 1.0x; both at 32: 0.97x), TPOT p50, and what the server
counted: the acceptance rate of proposed tokens and the generated tokens per step.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.cli import doc_parser
from loadtest.head_to_head import add_run_args, closed_loop_args, run_and_publish, scenario_table
from loadtest.results import BenchmarkResults

REPO = Path(__file__).resolve().parent.parent
OFF, ON = "speculation off", "speculation on"


@dataclass(frozen=True)
class Scenario:
    workload: str  # "quote" or "chat"
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.workload} c={self.concurrency}"

    @property
    def target(self) -> float:
        """Issue #28's floor for on / off."""
        if self.concurrency == 1:
            return 1.8 if self.workload == "quote" else 1.0
        return 0.97

    @property
    def ignores_eos(self) -> bool:
        """Exact output lengths by default only where the model's own end is not the point (the
        module docstring says why quote answers end at the end of turn)."""
        return self.workload != "quote"


def loadtest_args(s: Scenario, a: argparse.Namespace, off_cmd: str, on_cmd: str, out: Path) -> list[str]:
    a = argparse.Namespace(
        **{**vars(a), "ignore_eos": s.ignores_eos if a.ignore_eos is None else a.ignore_eos}
    )
    if s.workload == "quote":
        workload = ["--workload", "quote"]
    else:  # loadtest.peers' decode scenario
        workload = ["--workload", "orca", "--input-len-min", "64", "--input-len-max", "64"]
        workload += ["--output-len-min", "64", "--output-len-max", "128"]
    return closed_loop_args(workload, s.concurrency, a, [(OFF, off_cmd), (ON, on_cmd)], out)


@dataclass(frozen=True)
class Figures:
    output_tok_s: float
    tpot_p50_ms: float | None
    acceptance: float | None  # accepted / proposed tokens, as the server counted them
    tokens_per_step: float | None  # generated tokens per engine step


def figures(results: BenchmarkResults) -> dict[str, Figures]:
    out: dict[str, Figures] = {}
    for run in results.runs:
        s = run.summary
        server = s.extras.get("server", {})
        out[run.label] = Figures(
            s.output_token_throughput,
            s.tpot_ms.p50,
            server.get("spec_acceptance_rate"),
            server.get("generation_tokens_per_step"),
        )
    return out


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def table(rows: list[tuple[Scenario, dict[str, Figures]]]) -> str:
    header = (
        "| scenario | off tok/s | on tok/s | on / off | target | TPOT p50 off vs on (ms) | acceptance "
        "| tokens / step off vs on |\n|---|---:|---:|---:|---:|---|---:|---|"
    )
    return scenario_table(
        header, rows, (OFF, ON), _line, lambda s: f"| {s.name} | - | - | - | {s.target:.2f}x | - | - | - |"
    )


def _line(s: Scenario, off: Figures, on: Figures) -> str:
    ratio = on.output_tok_s / off.output_tok_s if off.output_tok_s else float("nan")
    mark = "" if ratio >= s.target else " (below)"
    return (
        f"| {s.name} | {off.output_tok_s:.1f} | {on.output_tok_s:.1f} | **{ratio:.2f}x**{mark} | "
        f"{s.target:.2f}x | {_num(off.tpot_p50_ms, '.1f')} vs {_num(on.tpot_p50_ms, '.1f')} | "
        f"{_num(on.acceptance and on.acceptance * 100, '.0f')}% | "
        f"{_num(off.tokens_per_step, '.2f')} vs {_num(on.tokens_per_step, '.2f')} |"
    )


def _lengths(ignore_eos: bool | None) -> str:
    if ignore_eos is None:
        return "quote answers end at the end of turn, chat outputs have exact lengths"
    return "exact output lengths" if ignore_eos else "outputs end at the end of turn"


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("python -m loadtest.speculation", __doc__)
    p.add_argument(
        "--server-command",
        default=f"{shlex.quote(sys.executable)} -m server --model default",
        help="the server both configurations run; `--speculative off` is added for one of them",
    )
    p.add_argument("--workloads", default="quote,chat", help="comma-separated: quote, chat")
    p.add_argument("--concurrency", default="1,32", help="closed-loop concurrencies")
    add_run_args(p, REPO / "loadtest-results" / "speculation")
    p.set_defaults(ignore_eos=None)  # per workload (Scenario.ignores_eos) unless the flag says
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    base = a.server_command.strip()
    off_cmd, on_cmd = f"{base} --speculative off", base
    scenarios = [
        Scenario(w.strip(), int(c))
        for c in a.concurrency.split(",")
        for w in a.workloads.split(",")
        if w.strip()
    ]
    run_and_publish(
        scenarios,
        a,
        lambda s, out: loadtest_args(s, a, off_cmd, on_cmd, out),
        lambda s: f"{s.workload}-c{s.concurrency}.json",
        figures,
        table,
        f"`{base}` with `--speculative off` and without, in one run ({a.duration:g} s per server and "
        f"scenario; {_lengths(a.ignore_eos)}).",
        "speculation.md",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
