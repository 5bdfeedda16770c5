"""What loadtest.peers and loadtest.speculation share (loadtest/head_to_head.py): the flags each
scenario's load test gets, and the report's note on failed requests."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest import head_to_head, peers
from loadtest.metrics import summarize
from loadtest.records import ErrorKind, RequestRecord
from loadtest.results import BenchmarkResults, RunResult


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    head_to_head.add_run_args(p, Path("out"))
    return p.parse_args(argv)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_each_scenario_gets_the_request_timeout():
    servers = [("a", "cmd a"), ("b", "cmd b")]
    default = head_to_head.closed_loop_args([], 32, _parse([]), servers, Path("x.json"))
    # A guard against a hung server: 600 s cut off a peer's requests at 32 streams of an 8B model.
    assert float(_flag(default, "--request-timeout")) == head_to_head.REQUEST_TIMEOUT_S >= 3600
    chosen = head_to_head.closed_loop_args(
        [], 32, _parse(["--request-timeout", "90"]), servers, Path("x.json")
    )
    assert float(_flag(chosen, "--request-timeout")) == 90


def _record(i: int, ok: bool) -> RequestRecord:
    r = RequestRecord(index=i, prompt_len=64, max_tokens=4, scheduled_time=0.0, send_time=0.0)
    if ok:
        r.first_token_time, r.token_times, r.end_time, r.output_tokens = 1.0, [1.0, 1.5, 2.0, 2.5], 2.5, 4
    else:
        r.error, r.error_kind = "no answer in 600 s", ErrorKind.TIMEOUT
    return r


def _results(outcomes: dict[str, list[bool]]) -> BenchmarkResults:
    runs = []
    for label, oks in outcomes.items():
        records = [_record(i, ok) for i, ok in enumerate(oks)]
        runs.append(RunResult(label=label, rate=float("inf"), summary=summarize(records), records=records))
    return BenchmarkResults(config={}, runs=runs)


def test_a_server_whose_requests_failed_is_named_under_the_table():
    results = _results({"orca-serve": [True] * 3, "llama-server": [True, False, False]})
    [note] = head_to_head.failure_notes("decode c=32", results)
    assert "decode c=32, llama-server: 2 of 3 requests failed (timeout 2)" in note
    assert "--request-timeout" in note
    assert (
        head_to_head.failure_notes("decode c=1", _results({"orca-serve": [True], "llama-server": [True]}))
        == []
    )


def test_the_peers_report_carries_the_note(tmp_path: Path, monkeypatch):
    """run_and_publish as peers.main calls it (which would first probe a llama-server binary), the load
    test replaced by saved results: the table, then the note."""
    results = _results({peers.ORCA: [True, True], peers.LLAMA: [True, False]})

    def fake_main(argv: list[str]) -> int:
        results.save(Path(_flag(argv, "--output")))
        return 0

    monkeypatch.setattr(head_to_head.cli, "main", fake_main)
    a = _parse(["--output-dir", str(tmp_path)])
    scenarios = peers.scenarios([32], 512)[:1]
    head_to_head.run_and_publish(
        scenarios,
        a,
        lambda s, out: peers.loadtest_args(s, a, "orca", "llama", out),
        lambda s: "decode.json",
        peers.figures,
        lambda rows: peers.table(rows, 512),
        "intro.",
        "peers.md",
    )
    report = (tmp_path / "peers.md").read_text()
    assert "| decode c=32 |" in report
    assert report.rstrip().endswith("(a timeout: raise --request-timeout).")
    assert "decode c=32, llama-server: 1 of 2 requests failed (timeout 1)" in report
