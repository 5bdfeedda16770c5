"""loadtest.metrics on synthetic timelines whose answers are known by hand."""

from __future__ import annotations

import math

import pytest

from loadtest import metrics
from loadtest.metrics import SLO, capacity_at_latency, distribution, summarize
from loadtest.records import ErrorKind, RequestRecord


def timeline(
    send: float, tokens: list[float], index: int = 0, max_tokens: int | None = None, prompt_len: int = 10
) -> RequestRecord:
    """A completed request: sent at `send`, one streamed token at each time in `tokens`."""
    return RequestRecord(
        index=index,
        prompt_len=prompt_len,
        max_tokens=len(tokens) if max_tokens is None else max_tokens,
        scheduled_time=send,
        send_time=send,
        first_token_time=tokens[0],
        token_times=list(tokens),
        end_time=tokens[-1],
        output_tokens=len(tokens),
    )


def failed(send: float, kind: str, index: int = 0) -> RequestRecord:
    return RequestRecord(index, 10, 4, send, send_time=send, error_kind=kind, error="boom")


def test_per_request_metrics():
    r = timeline(1.0, [1.5, 1.7, 2.0, 2.1])
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.e2e_latency(r) == pytest.approx(1.1)
    assert metrics.tpot(r) == pytest.approx((1.1 - 0.5) / 3)  # (e2e - ttft) / (tokens - 1)
    assert metrics.itls(r) == pytest.approx([0.2, 0.3, 0.1])
    assert metrics.normalized_latency(r) == pytest.approx(1.1 / 4)  # the paper's ms/token, in seconds


def test_usage_count_drives_tpot_when_chunks_hold_several_tokens():
    r = timeline(0.0, [0.1, 0.5])
    r.output_tokens = 5  # the server's usage says 5 tokens arrived in 2 chunks
    assert metrics.tpot(r) == pytest.approx(0.4 / 4)
    assert metrics.normalized_latency(r) == pytest.approx(0.5 / 5)
    assert metrics.itls(r) == pytest.approx([0.4])  # ITL stays per chunk, as in vLLM


def test_single_token_request_has_no_tpot_and_meets_a_tpot_slo():
    r = timeline(0.0, [0.2])
    assert metrics.tpot(r) is None
    assert metrics.itls(r) == []
    assert SLO("tpot", 1.0).met_by(r)
    assert not SLO("ttft", 100.0).met_by(r)  # 200 ms > 100 ms


def test_failed_requests_have_no_latencies():
    r = failed(0.0, ErrorKind.TIMEOUT)
    assert not r.ok
    for fn in (metrics.ttft, metrics.e2e_latency, metrics.tpot, metrics.normalized_latency):
        assert fn(r) is None
    assert not metrics.meets_slos(r, [])


def test_distribution_percentiles_match_linear_interpolation():
    d = distribution(range(1, 101))
    assert (d.count, d.mean, d.min, d.max) == (100, 50.5, 1, 100)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert distribution([0.25], scale=1000.0).p99 == pytest.approx(250.0)
    empty = distribution([])
    assert empty.count == 0 and math.isnan(empty.p50)


def test_slo_parsing():
    assert SLO.parse("ttft:500") == SLO("ttft", 500.0)
    assert SLO.parse("TPOT: 50.5") == SLO("tpot", 50.5)
    for bad in ("ttft", "speed:3", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_summary_throughputs_goodput_and_errors():
    fast = timeline(0.0, [0.1, 0.2, 0.3, 0.4], index=0)  # ttft 100 ms, tpot 100 ms
    slow_start = timeline(0.5, [1.2, 1.3], index=1)  # ttft 700 ms, tpot 100 ms
    slow_decode = timeline(1.0, [1.1, 1.6, 2.0], index=2, max_tokens=5)  # tpot 450 ms; short output
    records = [
        fast,
        slow_start,
        slow_decode,
        failed(1.5, ErrorKind.http_error(503), 3),
        failed(1.6, ErrorKind.TIMEOUT, 4),
    ]
    slos = [SLO("ttft", 500.0), SLO("tpot", 200.0)]
    s = summarize(records, slos)
    assert s.duration_s == pytest.approx(2.0)  # first arrival at 0 to the last end
    assert (s.num_requests, s.completed) == (5, 3)
    assert s.request_throughput == pytest.approx(3 / 2.0)
    assert s.output_token_throughput == pytest.approx((4 + 2 + 3) / 2.0)
    assert s.total_token_throughput == pytest.approx((30 + 9) / 2.0)
    assert s.goodput == pytest.approx(1 / 2.0)  # only `fast` meets both SLOs
    assert s.errors == {"http_503": 1, "timeout": 1}
    assert s.short_outputs == 1
    assert s.ttft_ms.count == 3 and s.ttft_ms.p50 == pytest.approx(100.0)
    assert s.itl_ms.count == 3 + 1 + 2  # gaps pooled over completed requests
    assert s.normalized_latency_ms.p50 == pytest.approx(1000.0 * 1.0 / 3)  # of 100, 333 and 400 ms
    assert summarize(records).goodput is None  # no SLOs, no goodput


def test_summary_round_trips_through_json_with_empty_distributions():
    s = summarize([failed(0.0, ErrorKind.CONNECTION)])
    data = s.to_dict()
    assert data["ttft_ms"]["p50"] is None  # NaN is not JSON
    again = metrics.Summary.from_dict(data)
    assert math.isnan(again.ttft_ms.p50) and again.errors == {"connection": 1}


def test_prompt_length_mismatches_are_counted():
    r = timeline(0.0, [0.1, 0.2], prompt_len=10)
    r.prompt_tokens_reported = 11
    assert summarize([r, timeline(0.0, [0.1])]).prompt_len_mismatches == 1


def test_capacity_at_latency_interpolates_between_rates():
    points = [(1.0, 10.0), (2.0, 20.0), (3.0, 40.0)]
    cap = capacity_at_latency(points, 30.0)
    assert cap is not None and cap.crossed and cap.load == pytest.approx(2.5)
    under_all = capacity_at_latency(points, 50.0)
    assert under_all is not None and not under_all.crossed and under_all.load == 3.0
    assert capacity_at_latency(points, 5.0) is None
    # An infinite offered rate has no place on a rate axis.
    with_inf = capacity_at_latency([(1.0, 10.0), (math.inf, 12.0)], 30.0)
    assert with_inf is not None and with_inf.load == 1.0
    # Noise: a point back under the bound beyond the first crossing does not extend the capacity.
    noisy = [(1.0, 10.0), (2.0, 15.0), (3.0, 25.0), (4.0, 18.0)]
    cap = capacity_at_latency(noisy, 20.0)
    assert cap is not None and cap.crossed and cap.load == pytest.approx(2.5)


def test_server_counters_from_prometheus_text():
    from loadtest.server_metrics import counter_deltas, parse_counters

    def exposition(steps: float, preempted: float, prompt: float, generated: float) -> str:
        return (
            "# TYPE orca:engine_steps counter\n"
            f'orca:engine_steps_total{{model_name="m"}} {steps}\n'
            "# TYPE vllm:num_preemptions counter\n"
            f'vllm:num_preemptions_total{{model_name="m"}} {preempted}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{model_name="m"}} {prompt}\n'
            f'vllm:prompt_tokens_created{{model_name="m"}} 1.7e9\n'
            "# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{model_name="m",x="a"}} {generated / 2}\n'
            f'vllm:generation_tokens_total{{model_name="m",x="b"}} {generated / 2}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 3\n'
        )

    before = parse_counters(exposition(10, 0, 100, 20))
    assert before == {"steps": 10, "preemptions": 0, "prompt_tokens": 100, "generation_tokens": 20}
    after = parse_counters(exposition(30, 2, 400, 120))
    deltas = counter_deltas(before, after)
    assert deltas["steps"] == 20 and deltas["preemptions"] == 2
    assert deltas["tokens_per_step"] == pytest.approx((300 + 100) / 20)
    assert deltas["generation_tokens_per_step"] == pytest.approx(100 / 20)
    assert counter_deltas(None, after) == {}


def test_token_gaps_classify_iterations_by_batch_and_prefill():
    from loadtest.timeline import token_gaps

    a = timeline(0.0, [0.1, 0.2, 0.3, 0.5], index=0)  # alone, then joined by b's prefill in (0.3, 0.5]
    b = RequestRecord(1, 40, 2, 0.25, send_time=0.25, first_token_time=0.5, token_times=[0.5, 0.6])
    b.end_time, b.output_tokens = 0.6, 2
    gaps = sorted(token_gaps([a, b]), key=lambda g: (g.seconds, g.decoding))
    assert [(round(g.seconds, 3), g.decoding, g.prefill_tokens) for g in gaps] == [
        (0.1, 1, 0),  # a alone
        (0.1, 1, 0),
        (0.1, 1, 0),  # b's own gap: a had ended at 0.5, so b decodes alone
        (0.2, 1, 40),  # a's last gap: the step that ran b's 40-token prefill
    ]


def test_default_latency_bound_starts_every_configuration_under_it():
    from loadtest.report import default_latency_bounds
    from loadtest.results import RunResult

    def run(label: str, rate: float, throughput: float, nlat_s: float) -> RunResult:
        r = timeline(0.0, [nlat_s])  # one token: normalized latency = e2e
        s = summarize([r])
        s.request_throughput = throughput
        return RunResult(label, rate, s, [r])

    # "b" is noisy: slower at its lowest rate than at the next.
    runs = [
        run("a", 1.0, 0.9, 0.010),
        run("a", 2.0, 1.8, 0.012),
        run("b", 1.0, 0.9, 0.030),
        run("b", 2.0, 1.7, 0.020),
    ]
    assert default_latency_bounds(runs) == pytest.approx([60.0])  # 2 x b's 30 ms at its lowest rate
