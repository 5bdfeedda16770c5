"""What an operator sees: Prometheus metrics under vLLM's names (separate per app), request ids in
every log line about a request, and the periodic stats line."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fakes import (
    MODEL,
    FakeRunner,
    loop_of,
    make_app,
    metric,
    running_app,
    serving,
    wait_until,
)

from server.middleware import RequestIdFilter

VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:iteration_tokens_total_count",
]


@pytest.fixture
async def client(tokenizer):
    async with running_app(make_app(tokenizer)) as c:
        yield c


async def test_metrics(client):
    await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    text = (await client.get("/metrics")).text
    for name in VLLM_NAMES:
        assert name in text, name
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "iteration_tokens_total"):
        assert f"vllm:{histogram}_bucket" in text, histogram
    assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 3.0' in text
    prompt_tokens = len((await client.post("/tokenize", json={"prompt": "Hello"})).json()["tokens"])
    assert f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {float(prompt_tokens)}' in text
    assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} 1.0' in text


async def test_two_apps_in_one_process_keep_separate_metrics(tokenizer):
    async with running_app(make_app(tokenizer)) as a, running_app(make_app(tokenizer)) as b:
        await a.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 2.0' in (await a.get("/metrics")).text
        # b's series exists from the start, at 0: a's tokens are not counted there.
        assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 0.0' in (await b.get("/metrics")).text


async def test_metrics_use_vllm_names(client):
    for stream in (False, True):
        body = {"prompt": "hello", "max_tokens": 4, "stream": stream}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    text = (await client.get("/metrics")).text
    for name in VLLM_NAMES:
        metric(text, name, model_name=MODEL)
    assert metric(text, "vllm:request_queue_time_seconds_count") == 2
    assert metric(text, "vllm:generation_tokens_total") == 8


async def test_speculative_decoding_counters_and_generated_tokens(tokenizer):
    """A model that repeats itself: n-gram proposals are verified and accepted, /metrics counts them
    (ours and vLLM's names), and every token is counted once as generated."""
    runner = FakeRunner(token_fn=lambda context: 1234)  # the same token, over and over
    async with running_app(make_app(tokenizer, runner)) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
        )
        assert r.json()["usage"]["completion_tokens"] == 40
        text = (await client.get("/metrics")).text
    proposed = metric(text, "orca:spec_proposed_tokens_total", model_name=MODEL)
    accepted = metric(text, "orca:spec_accepted_tokens_total", model_name=MODEL)
    assert 0 < accepted == proposed  # the model always says what was proposed
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == proposed
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert 0 < metric(text, "vllm:spec_decode_num_drafts_total") < 40
    assert metric(text, "vllm:generation_tokens_total") == 40
    assert metric(text, "orca:engine_steps_total") < 40  # several tokens a step


async def test_request_id_in_every_log_line_about_a_request(tokenizer, caplog):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=1, max_num_seqs=1)
    caplog.handler.addFilter(RequestIdFilter())
    async with serving(app, runner) as client:
        runner.gate.clear()
        engine = loop_of(app)
        req = {"prompt": "a", "max_tokens": 1}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=req))]
        await wait_until(lambda: engine.stats().running == 1)
        tasks.append(asyncio.create_task(client.post("/v1/completions", json=req)))
        await wait_until(lambda: engine.stats().waiting == 1)
        with caplog.at_level(logging.INFO):
            r = await client.post(
                "/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "abc-123"}
            )
        assert r.status_code == 429 and r.headers["x-request-id"] == "abc-123"
        runner.gate.set()
        await asyncio.gather(*tasks)
        # An id that could forge log lines is replaced.
        r = await client.get("/health", headers={"X-Request-Id": "x\nFAKE LOG LINE"})
        assert r.headers["x-request-id"] != "x\nFAKE LOG LINE" and len(r.headers["x-request-id"]) == 32
    [line] = [rec for rec in caplog.records if "queue full" in rec.getMessage()]
    assert line.request_id == "abc-123"
    # The access log line is written inside the request too, so it carries the same id.
    [access] = [rec for rec in caplog.records if rec.name == "server.access" and rec.request_id == "abc-123"]
    assert "POST /v1/completions 429" in access.getMessage()


async def test_periodic_stats_line(tokenizer):
    from server.stats_log import StatsLogger

    app = make_app(tokenizer)
    async with running_app(app) as client:
        state = app.state.server
        stats_logger = StatsLogger(state.metrics, state._stats)
        assert stats_logger.line() is None  # the first call only sets the mark
        assert stats_logger.line() is None  # idle: quiet
        assert (
            await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        ).status_code == 200
        line = stats_logger.line()
        assert line is not None
        for part in (
            "Avg prompt throughput",
            "Avg generation throughput",
            "Running: 0 reqs",
            "KV cache usage",
        ):
            assert part in line


async def test_requests_counted_per_route(tokenizer):
    """orca:http_requests by the route's path template (ids in paths make no new series), method and
    status; paths no route serves are "unmatched"."""
    async with running_app(make_app(tokenizer)) as client:
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        await client.post("/v1/messages", json={"model": MODEL, "messages": []})
        for rid in ("resp_a", "resp_b"):
            await client.get(f"/v1/responses/{rid}")
        await client.get("/no/such/path")
        text = (await client.get("/metrics")).text
    assert metric(text, "orca:http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert metric(text, "orca:http_requests_total", route="/v1/messages", method="POST", status="400") == 1
    assert metric(text, "orca:http_requests_total", route="/v1/responses/{response_id}", status="404") == 2
    assert metric(text, "orca:http_requests_total", route="unmatched", method="GET", status="404") == 1
