"""Prefix caching as clients and operators see it: usage.prompt_tokens_details.cached_tokens (OpenAI's
field) in completions, chat and the streamed usage chunk; vLLM's prefix-cache counters and a KV usage
that counts cached-but-unused blocks as free on /metrics; the flag."""

from __future__ import annotations

import pytest
from fakes import MODEL, drained, make_app, metric, parse_sse, running_app

from server.cli import parse_args

BLOCK = 16  # the fake runner's block size
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. " * 4


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
async def app(tokenizer):
    app = make_app(tokenizer)
    async with running_app(app) as client:
        app.state.client = client
        yield app


async def test_a_repeated_completion_prompt_reports_its_cached_tokens(app):
    client = app.state.client
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 3, "temperature": 0}
    first = (await client.post("/v1/completions", json=body)).json()
    second = (await client.post("/v1/completions", json=body)).json()
    n = first["usage"]["prompt_tokens"]
    assert n > 2 * BLOCK and cached(first) == 0
    assert cached(second) == (n - 2) // BLOCK * BLOCK  # all but the block(s) holding the last two tokens
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


async def test_a_chat_turn_reports_the_history_it_reused_also_when_streamed(app):
    client = app.state.client
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Tell me a story."}]
    turn1 = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})).json()
    history_tokens = turn1["usage"]["prompt_tokens"]
    messages += [turn1["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = parse_sse(r.text)
    usage = events[-2]["usage"]  # the last chunk before [DONE]: no choices, the usage
    assert events[-2]["choices"] == [] and usage["prompt_tokens"] > history_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= history_tokens // BLOCK * BLOCK
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


async def test_n_choices_count_their_prompt_once(app):
    client = app.state.client
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2, "n": 4, "temperature": 1.0, "seed": 3}
    first = (await client.post("/v1/completions", json=body)).json()
    second = (await client.post("/v1/completions", json=body)).json()
    n = first["usage"]["prompt_tokens"]
    assert cached(first) == 0  # three choices reused the first one's blocks, but none was cached before
    assert cached(second) == (n - 2) // BLOCK * BLOCK
    text = (await client.get("/metrics")).text
    # The prompt was computed once for the four choices of the first request, then what the cache
    # never serves (past the full blocks before the last two tokens) once per choice.
    assert metric(text, "orca:prompt_tokens_computed_total") == n + 7 * (n - (n - 2) // BLOCK * BLOCK)


async def test_metrics_count_queries_and_hits_and_cached_blocks_are_free(app):
    client = app.state.client
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2}
    for _ in range(2):
        await client.post("/v1/completions", json=body)
    await drained(app)
    text = (await client.get("/metrics")).text
    n = (await client.post("/v1/completions", json={**body, "max_tokens": 1})).json()["usage"][
        "prompt_tokens"
    ]
    assert metric(text, "vllm:prefix_cache_queries_total", model_name=MODEL) == 2 * n
    assert metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL) == (n - 2) // BLOCK * BLOCK
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0  # nothing running: cached blocks are free
    assert metric(text, "orca:kv_cache_blocks_used") == 0.0
    assert metric(text, "orca:kv_cache_blocks_cached") >= n // BLOCK


async def test_caching_can_be_turned_off(tokenizer):
    async with running_app(make_app(tokenizer, enable_prefix_caching=False)) as client:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 2}
        answers = [(await client.post("/v1/completions", json=body)).json() for _ in range(2)]
        text = (await client.get("/metrics")).text
    assert [cached(a) for a in answers] == [0, 0]
    assert metric(text, "vllm:prefix_cache_hits_total") == 0.0
    n = answers[0]["usage"]["prompt_tokens"]
    assert metric(text, "orca:prompt_tokens_computed_total") == 2 * n


def test_the_flag_is_on_by_default_and_can_be_turned_off():
    assert parse_args([]).scheduler.enable_prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"]).scheduler.enable_prefix_caching is False
    assert parse_args(["--enable-prefix-caching"]).scheduler.enable_prefix_caching is True
