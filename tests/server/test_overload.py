"""Overload: the bounded admission queue (429 with Retry-After), memory under a flood, and request
timeouts (408) that free their KV blocks. Nothing waits on a clock: the fake runner's gate holds a
step in flight and wait_until polls for states."""

from __future__ import annotations

import asyncio

from fakes import (
    FakeRunner,
    drained,
    error_of,
    loop_of,
    make_app,
    metric,
    parse_sse,
    serving,
    wait_until,
)

CHAT = [{"role": "user", "content": "hi"}]


async def test_queue_bound_answers_429_with_retry_after(tokenizer):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=3, max_num_seqs=1, retry_after_s=2)
    async with serving(app, runner) as client:
        engine = loop_of(app)
        runner.gate.clear()  # the first request's step stays in flight; the others wait
        req = {"prompt": "hello", "max_tokens": 2}
        first = asyncio.create_task(client.post("/v1/completions", json=req))
        await wait_until(lambda: engine.stats().running == 1)
        queued = [asyncio.create_task(client.post("/v1/completions", json=req)) for _ in range(3)]
        await wait_until(lambda: engine.stats().waiting == 3)
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        err = error_of(r, 429)
        assert err["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "2"
        # A request for several choices counts each of them.
        err = error_of(await client.post("/v1/completions", json={**req, "n": 2}), 429)
        runner.gate.set()
        for r in await asyncio.gather(first, *queued):
            assert r.status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, "orca:requests_rejected_total", reason="queue_full") == 2
        # Served again once the queue has room.
        assert (await client.post("/v1/completions", json=req)).status_code == 200


async def test_flood_keeps_memory_bounded(tokenizer):
    """300 concurrent requests against a queue of 8: the loop never holds more than max_num_seqs + 8
    requests, the rest get 429, and afterwards nothing is left behind."""
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=8, max_num_seqs=4)
    async with serving(app, runner) as client:
        engine = loop_of(app)
        runner.gate.clear()
        peak = 0

        def watch() -> None:
            nonlocal peak
            s = engine.stats()
            peak = max(peak, s.running + s.waiting, len(engine._scheduler.requests))

        engine.add_step_listener(lambda _: watch())
        req = {"prompt": "flood", "max_tokens": 3, "stream": True}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=req)) for _ in range(300)]
        await wait_until(lambda: sum(t.done() for t in tasks) >= 300 - 12)
        watch()
        runner.gate.set()
        codes = [r.status_code for r in await asyncio.gather(*tasks)]
        assert set(codes) == {200, 429}
        assert codes.count(200) <= 4 + 8 and peak <= 4 + 8
        await drained(app)
        assert not engine._queues and not engine._scheduler.requests


async def test_request_timeout_is_408_and_frees_blocks(tokenizer):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, request_timeout_s=0.05)
    async with serving(app, runner) as client:
        runner.gate.clear()  # the step never ends while the gate is closed: the deadline must fire
        err = error_of(await client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 5}), 408)
        assert err["code"] == "request_timeout"
        r = await client.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stream": True}
        )
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        runner.gate.set()
        await drained(app)
        text = (await client.get("/metrics")).text
        assert metric(text, "orca:requests_rejected_total", reason="timeout") == 2
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
