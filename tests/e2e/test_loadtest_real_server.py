"""One short load test against the real server (`python -m server`) on the tiny random Llama."""

from __future__ import annotations

import importlib.util

import pytest

from loadtest import cli
from loadtest.results import BenchmarkResults

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("server.cli") is None, reason="the server (server/cli.py) is not there yet"
)


@pytest.mark.slow  # a server start and a timed run (~12 s): in `make test-slow`
def test_short_run_against_the_real_server(tmp_path, tiny_llama_dir):
    out = tmp_path / "real.json"
    rc = cli.main(
        [
            "--launch", f"python -m server --model {tiny_llama_dir} --max-num-seqs 4", "--label", "tiny",
            "--launch-timeout", "120", "--request-rates", "inf", "--num-requests", "4", "--warmup-requests", "1",
            "--input-len-min", "8", "--input-len-max", "40", "--output-len-min", "2", "--output-len-max", "6",
            "--slo", "ttft:600000", "--output", str(out), "--no-progress", "--no-plot",
        ]
    )  # fmt: skip
    results = BenchmarkResults.load(out)
    log = (tmp_path / "real-server-tiny.log").read_text(errors="replace")[-3000:]
    assert rc == 0, log
    (run,) = results.runs
    # The tokenizer came from the served model's directory; prompts went as token ids.
    assert run.extras["tokenizer"] == str(tiny_llama_dir) and run.extras["prompt_format"] == "ids"
    assert run.summary.errors == {}, [r.error for r in run.records]
    for record in run.records:
        assert record.ok
        assert record.prompt_tokens_reported == record.prompt_len  # exact prompt lengths
        assert record.output_tokens == record.max_tokens  # ignore_eos + min_tokens honoured
        assert record.send_time <= record.first_token_time <= record.end_time
    assert run.summary.goodput == pytest.approx(run.summary.request_throughput)
    # The server's own counters over the run (its /metrics, before and after) agree with the client.
    server = run.summary.extras["server"]
    assert server["steps"] > 0 and server["preemptions"] == 0
    assert server["generation_tokens"] == sum(r.output_tokens for r in run.records)
