"""The paper's experiment (loadtest.paper) end to end: four servers on a tiny model, two rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import paper
from loadtest.results import BenchmarkResults


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_experiment_compares_the_schedulers_with_speculation_off_and_on(
    tiny_llama_dir: Path, tmp_path: Path
):
    rc = paper.main(
        ["--model", str(tiny_llama_dir), "--server-args", "--dtype float32 --device cpu --num-kv-blocks 256"]
        + [
            "--request-rates",
            "4,16",
            "--num-requests",
            "4",
            "--output-len-max",
            "8",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    runs = BenchmarkResults.load(tmp_path / "paper.json").runs
    assert {(r.label, r.rate) for r in runs} == {
        (label, rate) for label, _ in paper.CONFIGS for rate in (4, 16)
    }
    assert all(r.summary.completed == 4 for r in runs)
    report = (tmp_path / "paper.md").read_text()
    latency_rows = [line for line in report.splitlines() if line.startswith(("| 4 |", "| 16 |"))]
    assert len(latency_rows) == 2 and all(line.count("req/s") == 4 for line in latency_rows)
    [head] = [line for line in report.splitlines() if line.startswith("| bound")]
    assert "iteration / request" in head and "iteration+spec / request+spec" in head
    assert (tmp_path / "paper-throughput-latency.png").is_file()
