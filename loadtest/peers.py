"""`python -m loadtest.peers`: orca-serve against llama.cpp's llama-server on the same GGUF file, in one run.

    python -m loadtest.peers [--duration 60] [--concurrency 1,8,32] [--output-dir results/peers]
    make bench-peers

Both servers start from the same file (the default model's GGUF unless --gguf), are measured in turn
with the same requests (`python -m loadtest --interleave`, so drift in a shared machine's load falls on
both alike), and the table gives orca-serve's figures as ratios of llama-server's:

- decode: closed-loop streaming chat at each --concurrency, greedy, 64-128 output tokens made exact with
  `ignore_eos`, 64-token prompts; output tok/s, TTFT p50 and TPOT p50;
- prefill: one request at a time with --prefill-len-token prompts and 8 output tokens; prefill tok/s is
  the prompt length over TTFT p50.

llama-server runs as its README says (`-t <cores> -np 32 -c 65536`); orca-serve as `make serve` starts
it (`python -m server --model <gguf>`, every default). The project needs llama.cpp for nothing but this
benchmark: ../shared/peers/llama.cpp/ holds a portable build that picks its CPU kernels at run time
(--llama-server or $ORCA_LLAMA_SERVER to use another).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.cli import doc_parser
from loadtest.head_to_head import add_run_args, closed_loop_args, run_and_publish, scenario_table
from loadtest.results import BenchmarkResults
from models.options import cache_root

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA_SERVER = REPO.parent / "shared" / "peers" / "llama.cpp" / "llama-server"
ORCA, LLAMA = "orca-serve", "llama-server"


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    input_len: int
    output_min: int
    output_max: int


@dataclass(frozen=True)
class Figures:
    """One server's figures in one scenario."""

    output_tok_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float | None
    completed: int
    errors: int


def scenarios(concurrency: list[int], prefill_len: int) -> list[Scenario]:
    decode = [Scenario(f"decode c={c}", c, 64, 64, 128) for c in concurrency]
    return [*decode, Scenario(f"prefill {prefill_len}", 1, prefill_len, 8, 8)]


def runnable_llama_server(binary: Path, gguf: Path) -> tuple[Path, str]:
    """The llama-server to run, and the CPU kernel variant it loads here.

    Two things can stand in the way of the portable build, and both are handled in a copy kept in
    orca-serve's cache (the binaries find their libraries beside themselves, $ORIGIN):
    - a store that keeps no symbolic links leaves the library links as small text files holding the
      target's name (the loader fails with "file too short"): they are made links again;
    - llama.cpp loads the variant that scores best for the CPU's flags, and a variant can still die of
      an illegal instruction on a virtual machine (seen here: the sapphirerapids one, on a CPU whose AMX
      works for orca-serve): such a variant is set aside, so the best one that runs is measured.
    """
    import hashlib
    import re
    import shutil
    import subprocess
    import tempfile

    folder = binary.parent
    files = sorted(folder.iterdir())
    key = hashlib.sha256(
        "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode()
    )
    staged = cache_root() / "peers" / f"llama.cpp-{key.hexdigest()[:12]}"
    if not (staged / binary.name).is_file():
        staged.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=staged.parent))
        for f in files:
            target = f.read_text(errors="replace").strip() if f.stat().st_size < 256 else ""
            if f.name.startswith("lib") and target and (folder / target).is_file():
                (tmp / f.name).symlink_to(target)
            else:
                shutil.copy2(f, tmp / f.name)
        tmp.rename(staged)
    bench = staged / "llama-bench"
    while True:
        probe = subprocess.run(
            [str(bench), "-m", str(gguf), "-t", "1", "-p", "8", "-n", "1", "-r", "1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        loaded = re.findall(r"loaded CPU backend from (\S+)", probe.stderr + probe.stdout)
        variant = Path(loaded[-1]).stem.removeprefix("libggml-cpu-") if loaded else "unknown"
        if probe.returncode == 0 or not loaded or probe.returncode not in (-4, 132):
            return staged / binary.name, variant
        aside = staged / "set-aside"
        aside.mkdir(exist_ok=True)
        print(
            f"llama.cpp's {variant} kernels die of an illegal instruction here; setting them aside",
            file=sys.stderr,
        )
        Path(loaded[-1]).rename(aside / Path(loaded[-1]).name)


def default_gguf() -> Path:
    from models.options import default_gguf_path  # no torch: only the package's file

    return default_gguf_path()


def loadtest_args(s: Scenario, a: argparse.Namespace, orca_cmd: str, llama_cmd: str, out: Path) -> list[str]:
    workload = [
        "--workload", "orca",
        "--input-len-min", str(s.input_len), "--input-len-max", str(s.input_len),
        "--output-len-min", str(s.output_min), "--output-len-max", str(s.output_max),
    ]  # fmt: skip
    return closed_loop_args(workload, s.concurrency, a, [(ORCA, orca_cmd), (LLAMA, llama_cmd)], out)


def figures(results: BenchmarkResults) -> dict[str, Figures]:
    out: dict[str, Figures] = {}
    for run in results.runs:
        s = run.summary
        out[run.label] = Figures(
            output_tok_s=s.output_token_throughput,
            ttft_p50_ms=s.ttft_ms.p50 or float("nan"),
            tpot_p50_ms=s.tpot_ms.p50,
            completed=s.completed,
            errors=sum(s.errors.values()),
        )
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(rows: list[tuple[Scenario, dict[str, Figures]]], prefill_len: int) -> str:
    """Markdown: each scenario's figures for both servers, orca-serve as a ratio of llama-server."""
    header = (
        "| scenario | llama-server tok/s | orca-serve tok/s | orca / llama | TTFT p50 orca vs llama (ms) "
        "| TPOT p50 orca vs llama (ms) |\n|---|---:|---:|---:|---|---|"
    )
    return scenario_table(
        header,
        rows,
        (ORCA, LLAMA),
        lambda s, o, ll: _line(s, o, ll, prefill_len),
        lambda s: f"| {s.name} | - | - | - | - | - |",
    )


def _line(s: Scenario, o: Figures, ll: Figures, prefill_len: int) -> str:
    if s.name.startswith("prefill"):
        # Prefill throughput of one request at a time: prompt tokens over the time to first token.
        o_tok, l_tok = prefill_len / (o.ttft_p50_ms / 1e3), prefill_len / (ll.ttft_p50_ms / 1e3)
        return (
            f"| {s.name} (prefill tok/s) | {l_tok:.0f} | {o_tok:.0f} | **{ratio(o_tok, l_tok)}** "
            f"| {o.ttft_p50_ms:.0f} vs {ll.ttft_p50_ms:.0f} | - |"
        )
    tpot = (
        f"{o.tpot_p50_ms:.1f} vs {ll.tpot_p50_ms:.1f}"
        if o.tpot_p50_ms is not None and ll.tpot_p50_ms is not None
        else "-"
    )
    return (
        f"| {s.name} | {ll.output_tok_s:.1f} | {o.output_tok_s:.1f} | **{ratio(o.output_tok_s, ll.output_tok_s)}** "
        f"| {o.ttft_p50_ms:.0f} vs {ll.ttft_p50_ms:.0f} | {tpot} |"
    )


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("python -m loadtest.peers", __doc__)
    p.add_argument(
        "--gguf", type=Path, default=None, help="the GGUF file both serve (default: the default model's)"
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=Path(os.environ.get("ORCA_LLAMA_SERVER", DEFAULT_LLAMA_SERVER)),
        help="llama.cpp's llama-server binary",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    p.add_argument("--orca-args", default="", help="extra flags for `python -m server` (default: none)")
    p.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies of the decode runs")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill run")
    add_run_args(p, REPO / "loadtest-results" / "peers")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not a.llama_server.is_file():
        print(
            f"llama-server not found at {a.llama_server} (--llama-server or $ORCA_LLAMA_SERVER)",
            file=sys.stderr,
        )
        return 2
    gguf = (a.gguf or default_gguf()).resolve()
    llama_server, variant = runnable_llama_server(a.llama_server, gguf)
    orca_cmd = (
        f"{shlex.quote(sys.executable)} -m server --model {shlex.quote(str(gguf))} {a.orca_args}".strip()
    )
    llama_cmd = (
        f"{shlex.quote(str(llama_server))} -m {shlex.quote(str(gguf))} -t {a.threads} -np 32 -c 65536 "
        "--host 127.0.0.1 --port {port}"
    )
    run_and_publish(
        scenarios([int(c) for c in a.concurrency.split(",")], a.prefill_len),
        a,
        lambda s, out: loadtest_args(s, a, orca_cmd, llama_cmd, out),
        lambda s: f"{s.name.replace(' ', '-').replace('=', '')}.json",
        figures,
        lambda rows: table(rows, a.prefill_len),
        f"Same GGUF ({gguf.name}), both servers measured in one run; {os.cpu_count()} cores; llama-server "
        f"-t {a.threads} -np 32 (its {variant} CPU kernels); orca-serve `python -m server` "
        f"{a.orca_args or '(defaults)'}.",
        "peers.md",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
