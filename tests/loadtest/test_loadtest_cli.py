"""`python -m loadtest` end to end against the model-free fake OpenAI server (loadtest.fakeserver)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from waiting import wait_for

from engine.ports import free_tcp_port
from loadtest import cli, plot
from loadtest.fakeserver import FakeConfig, create_app
from loadtest.launcher import build_command
from loadtest.results import BenchmarkResults
from loadtest.tokenizer import HFTokenizer

SMALL = ["--input-len-min", "8", "--input-len-max", "48", "--output-len-min", "1", "--output-len-max", "6"]


@contextmanager
def fake_server(config: FakeConfig) -> Iterator[str]:
    """The fake server on a uvicorn thread; yields its base URL."""
    port = free_tcp_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("fake server did not start")
        return server.started

    wait_for(started, poll_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir) -> HFTokenizer:
    return HFTokenizer(smollm2_tokenizer_dir)


def run_cli(args: list[str], output: Path) -> tuple[int, BenchmarkResults]:
    rc = cli.main([*args, "--output", str(output), "--no-progress", "--seed", "1"])
    return rc, BenchmarkResults.load(output)


def test_sweep_writes_results_and_plots_with_exact_lengths(tmp_path, tokenizer, smollm2_tokenizer_dir):
    out = tmp_path / "results.json"
    with fake_server(FakeConfig(tokenizer=tokenizer, step_ms=1.0)) as url:
        rc, results = run_cli(
            [
                "--base-url", url + "/v1", "--tokenizer", str(smollm2_tokenizer_dir),
                "--request-rates", "100,inf", "--num-requests", "6", "--slo", "ttft:60000", *SMALL,
            ],
            out,
        )  # fmt: skip
    assert rc == 0
    assert [(r.label, r.rate) for r in results.runs] == [("server", 100.0), ("server", float("inf"))]
    for run in results.runs:
        assert run.extras["prompt_format"] == "ids" and run.extras["model"] == "fake-model"
        assert [r.index for r in run.records] == list(range(6))
        assert all(r.ok for r in run.records)
        # Exact lengths: the server counted what was asked, and generated exactly max_tokens.
        assert all(r.prompt_tokens_reported == r.prompt_len for r in run.records)
        assert all(r.output_tokens == r.max_tokens == len(r.token_times) for r in run.records)
        assert all(r.send_time <= r.first_token_time <= r.end_time for r in run.records)
        s = run.summary
        assert s.completed == 6 and s.errors == {} and s.goodput == pytest.approx(s.request_throughput)
    # Both rates sent the same requests (same seed): configurations see identical traffic.
    first, second = results.runs
    assert [r.prompt_len for r in first.records] == [r.prompt_len for r in second.records]
    assert results.config["args"]["request_rates"] == [100.0, "inf"]
    assert (tmp_path / "results-throughput-latency.png").stat().st_size > 0
    assert (tmp_path / "results-cdf.png").stat().st_size > 0


def test_errors_are_counted_by_kind(tmp_path, tokenizer, smollm2_tokenizer_dir):
    out = tmp_path / "r.json"
    config = FakeConfig(tokenizer=tokenizer, step_ms=0.5, fail_every=3, break_every=4)
    with fake_server(config) as url:
        rc, results = run_cli(
            [
                "--base-url", url, "--tokenizer", str(smollm2_tokenizer_dir), "--warmup-requests", "0",
                "--num-requests", "12", "--output-len-min", "4", "--output-len-max", "4",
                "--input-len-max", "40",
            ],
            out,
        )  # fmt: skip
    assert rc == 0  # failed requests are results, not a failed benchmark
    (run,) = results.runs
    # Server-side request numbers 3, 6, 9, 12 get 503; 4 and 8 break mid-stream (12 already failed).
    assert run.summary.errors == {"http_503": 4, "stream": 2}
    assert run.summary.completed == 6
    broken = [r for r in run.records if r.error_kind == "stream"]
    assert all("injected stream error" in (r.error or "") for r in broken)


def test_text_fallback_chat_and_server_tokenizer(tmp_path, tokenizer):
    config = FakeConfig(tokenizer=tokenizer, step_ms=0.5, accept_token_ids=False)
    with fake_server(config) as url:
        # Token ids refused: auto falls back to text prompts, still of exact length (server tokenizer).
        rc, results = run_cli(
            ["--base-url", url, "--tokenizer", "server", "--num-requests", "4", *SMALL], tmp_path / "a.json"
        )
        assert rc == 0
        (run,) = results.runs
        assert run.extras["prompt_format"] == "text" and run.extras["tokenizer"].endswith("/tokenize")
        assert all(r.ok and r.prompt_tokens_reported == r.prompt_len for r in run.records)
        rc, results = run_cli(
            ["--base-url", url, "--tokenizer", "server", "--endpoint", "chat", "--num-requests", "3", *SMALL],
            tmp_path / "b.json",
        )
        assert rc == 0
        assert all(r.ok and r.output_tokens == r.max_tokens for r in results.runs[0].records)


def test_closed_loop_keeps_concurrency(tmp_path, tokenizer, smollm2_tokenizer_dir):
    with fake_server(FakeConfig(tokenizer=tokenizer, step_ms=2.0)) as url:
        rc, results = run_cli(
            [
                "--base-url", url, "--tokenizer", str(smollm2_tokenizer_dir), "--request-rates", "inf",
                "--duration", "1.0", "--max-concurrency", "2", "--warmup-requests", "0", *SMALL,
            ],
            tmp_path / "c.json",
        )  # fmt: skip
    assert rc == 0
    records = results.runs[0].records
    assert len(records) >= 2 and all(r.ok for r in records)
    # Never more than two in flight: at each send, at most one other request is still open.
    for r in records:
        open_ = [o for o in records if o is not r and o.send_time <= r.send_time < o.end_time]
        assert len(open_) <= 1
    assert all(r.scheduled_time < 1.0 for r in records)  # nothing admitted after the duration
    assert all(r.send_time >= r.scheduled_time for r in records)


def test_launch_compares_configurations_and_plot_cli(tmp_path, capsys, smollm2_tokenizer_dir):
    fake = f"python -m loadtest.fakeserver --step-ms 1 --max-batch 4 --tokenizer {smollm2_tokenizer_dir}"
    out = tmp_path / "sweep.json"
    rc = cli.main(
        [
            "--launch", f"{fake} --scheduling iteration", "--launch", f"{fake} --scheduling request",
            "--tokenizer", "server", "--prompt-format", "text", "--request-rates", "200,400", "--num-requests", "6",
            "--interleave", "--output", str(out), "--no-progress", *SMALL,
        ]
    )  # fmt: skip
    assert rc == 0
    results = BenchmarkResults.load(out)
    # Labels come from what sets the commands apart; each got its own server, now stopped.
    # Interleaved: both servers up at once, the configurations take turns at each rate.
    assert [(r.label, r.rate) for r in results.runs] == [
        ("scheduling=iteration", 200.0),
        ("scheduling=request", 200.0),
        ("scheduling=iteration", 400.0),
        ("scheduling=request", 400.0),
    ]
    assert all(r.summary.completed == 6 for r in results.runs)
    commands = {r.extras["command"] for r in results.runs}
    assert len(commands) == 2
    log = tmp_path / "sweep-server-scheduling_iteration.log"  # the server's output, for post-mortems
    assert log.exists()
    assert all(r.prompt_tokens_reported == r.prompt_len for run in results.runs for r in run.records)
    printed = capsys.readouterr().out
    assert "offered rate" in printed and "(1.0x)" in printed  # the equal-latency comparison

    again = tmp_path / "again.json"
    again.write_text(out.read_text())
    assert plot.main([str(out), str(again), "--at-latency", "5,50"]) == 0
    printed = capsys.readouterr().out
    assert "sweep:scheduling=request" in printed and "again:scheduling=request" in printed
    assert (tmp_path / "sweep-throughput-latency.png").exists()


def test_sliced_interleave_alternates_turns_and_pools_them(tmp_path, smollm2_tokenizer_dir):
    fake = f"python -m loadtest.fakeserver --step-ms 1 --max-batch 4 --tokenizer {smollm2_tokenizer_dir}"
    out = tmp_path / "sliced.json"
    rc = cli.main(
        [
            "--launch", f"{fake} --scheduling iteration", "--launch", f"{fake} --scheduling request",
            "--tokenizer", "server", "--prompt-format", "text", "--request-rates", "inf", "--max-concurrency",
            "2", "--num-requests", "7", "--slices", "3", "--interleave", "--output", str(out), "--no-progress",
            "--no-plot", *SMALL,
        ]
    )  # fmt: skip
    assert rc == 0
    runs = BenchmarkResults.load(out).runs
    assert [r.label for r in runs] == ["scheduling=iteration", "scheduling=request"]  # one result each
    for run in runs:
        assert run.extras["turns"] == 3 and run.summary.completed == 7  # 3 + 2 + 2 requests
        records = sorted(run.records, key=lambda r: r.send_time)
        # The turns follow each other on one timeline: each starts where the one before it ended.
        ends = [r.end_time for r in records]
        assert all(r.end_time is not None for r in records)
        assert run.summary.duration_s == pytest.approx(max(ends), abs=1e-5)  # times saved to 6 decimals
        assert [r.index for r in records] == [0, 1, 2, 0, 1, 0, 1]
        # Each turn has prompts of its own (a prefix cache holds the earlier turns'): index 0 of three
        # turns, three prompts.
        firsts = [r for r in records if r.index == 0]
        assert firsts[0].end_time <= firsts[1].send_time and firsts[1].end_time <= firsts[2].send_time
    assert cli.build_parser().parse_args(["--slices", "2", "--base-url", "http://x"]).slices == 2
    with pytest.raises(SystemExit):
        cli.main(["--base-url", "http://127.0.0.1:9", "--slices", "2", "--no-progress"])  # no --interleave


def test_auto_labels_name_what_differs():
    base = "python -m server --model default"
    assert cli.auto_labels([f"{base} --kv-policy lazy", f"{base} --kv-policy reserve"]) == [
        "kv-policy=lazy",
        "kv-policy=reserve",
    ]
    assert cli.auto_labels([base, f"{base} --no-chunked-prefill"]) == ["base", "no-chunked-prefill"]
    assert cli.auto_labels([base]) == ["server"]


def test_build_command_binds_loopback_and_uses_this_python():
    import sys

    env, argv = build_command("python -m server --model default", 4242)
    assert env == {} and argv[0] == sys.executable
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "4242"]
    assert build_command("srv --listen 127.0.0.1:{port}", 7) == ({}, ["srv", "--listen", "127.0.0.1:7"])
    env, argv = build_command("OMP_NUM_THREADS=1 A=b=c python -m server", 1)
    assert env == {"OMP_NUM_THREADS": "1", "A": "b=c"} and argv[0] == sys.executable


def test_non_loopback_targets_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--base-url", "http://10.0.0.1:8000"])
    assert "not loopback" in capsys.readouterr().err
    assert cli.is_loopback("http://localhost:8000") and cli.is_loopback("http://[::1]:80")


def test_results_json_is_strict(tmp_path, smollm2_tokenizer_dir):
    out = tmp_path / "strict.json"
    with fake_server(FakeConfig(step_ms=0.5, fail_every=1)) as url:  # every request fails
        rc = cli.main(
            [
                "--base-url", url, "--tokenizer", str(smollm2_tokenizer_dir), "--warmup-requests", "0",
                "--prompt-format", "ids", "--output", str(out), "--num-requests", "2", "--no-progress",
                "--no-plot", *SMALL,
            ]
        )  # fmt: skip
    assert rc == 0
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["runs"][0]["summary"]["errors"] == {"http_503": 2}


def test_api_key_is_sent_but_never_written(tmp_path, smollm2_tokenizer_dir):
    out = tmp_path / "key.json"
    with fake_server(FakeConfig(step_ms=0.5, api_key="s3cret-key")) as url:
        rc = cli.main(
            [
                "--base-url", url, "--api-key", "s3cret-key", "--tokenizer", str(smollm2_tokenizer_dir),
                "--num-requests", "1", "--warmup-requests", "0", "--prompt-format", "ids", "--output", str(out),
                "--no-progress", "--no-plot", *SMALL,
            ]
        )  # fmt: skip
    assert rc == 0
    assert BenchmarkResults.load(out).runs[0].summary.completed == 1  # the server accepted the key
    assert "s3cret-key" not in out.read_text()


def test_module_entry_points():
    import subprocess
    import sys

    for module in ("loadtest", "loadtest.plot", "loadtest.fakeserver"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
