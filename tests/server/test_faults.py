"""Faults: a disconnect storm frees every block, a failing step fails only its own requests, a dead
loop turns /health to 503 and ends waiting streams, and an engine error mid-stream reaches the client
(and the openai client) as an error event."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import openai
import pytest
from fakes import (
    MODEL,
    FakeRunner,
    drained,
    error_of,
    live_server,
    loop_of,
    make_app,
    metric,
    parse_sse,
    running_app,
    serving,
    wait_until,
)

from engine.contract import SampledToken, ScheduledSequence

CHAT = [{"role": "user", "content": "hi"}]


MARKED = 4242  # a prompt holding this token id makes FailingRunner's step raise


async def test_disconnect_storm_frees_every_block(tokenizer):
    """Clients that leave before their first token and in mid-stream, over real sockets."""
    runner = FakeRunner(num_kv_blocks=512)
    app = make_app(tokenizer, runner)
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        engine = loop_of(app)
        long = {"prompt": "storm", "max_tokens": 200, "ignore_eos": True, "stream": True}

        async def leave_before_first_token() -> None:
            async with client.stream("POST", "/v1/completions", json=long) as r:
                assert r.status_code == 200  # headers only: the step is held at the gate

        async def leave_mid_stream(chunks: int) -> None:
            async with client.stream("POST", "/v1/chat/completions", json={**long, "messages": CHAT}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen >= chunks:
                        return

        runner.gate.clear()
        await asyncio.gather(*(leave_before_first_token() for _ in range(16)))
        runner.gate.set()
        await asyncio.gather(*(leave_mid_stream(2 + i % 5) for i in range(24)))
        # Non-streamed requests cancelled while they run.
        posts = [
            asyncio.create_task(client.post("/v1/completions", json={**long, "stream": False}))
            for _ in range(8)
        ]
        await wait_until(lambda: engine.stats().kv_blocks_used > 0)
        for t in posts:
            t.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        await drained(app)
        text = (await client.get("/metrics")).text
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert metric(text, "vllm:num_requests_running") == 0
        r = await client.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


class FailingRunner(FakeRunner):
    """Raises inside the model step whenever a marked request is in the batch."""

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        if any(MARKED in seq.prompt_token_ids for seq in batch):
            super().step([])  # keep the step counter and gate behaviour
            raise RuntimeError("injected failure in the model step")
        return super().step(batch)


async def test_step_exception_fails_only_that_step(tokenizer):
    app = make_app(tokenizer, FailingRunner())
    async with running_app(app) as client:
        err = error_of(
            await client.post("/v1/completions", json={"prompt": [MARKED, 5], "max_tokens": 3}), 500
        )
        assert err["code"] == "generation_failed" and "injected failure" in err["message"]
        r = await client.post(
            "/v1/completions", json={"prompt": [5, MARKED], "max_tokens": 3, "stream": True}
        )
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "generation_failed"
        # The server goes on serving.
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        await drained(app)


async def test_loop_death_turns_health_503_and_errors_waiting_clients(tokenizer, monkeypatch):
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    async with serving(app, runner) as client:
        engine = loop_of(app)
        runner.gate.clear()
        req = {"prompt": "doomed", "max_tokens": 50, "ignore_eos": True}
        stream = asyncio.create_task(client.post("/v1/completions", json={**req, "stream": True}))
        plain = asyncio.create_task(client.post("/v1/completions", json=req))
        await wait_until(lambda: engine.stats().running + engine.stats().waiting == 2)

        def broken_schedule(*args: object, **kwargs: object) -> None:
            raise RuntimeError("scheduler bug outside the step")

        monkeypatch.setattr(engine._scheduler, "schedule", broken_schedule)
        runner.gate.set()  # the step in flight ends; the next turn of the loop dies
        events = parse_sse((await stream).text)
        assert events[-1] == "[DONE]" and "scheduler bug" in events[-2]["error"]["message"]
        assert "scheduler bug" in error_of(await plain, 500)["message"]
        err = error_of(await client.get("/health"), 503)
        assert err["code"] == "engine_dead"
        error_of(await client.post("/v1/completions", json=req), 503)


async def test_engine_failure_mid_stream(tokenizer):
    runner = FakeRunner(fail_at_step=3)
    async with running_app(make_app(tokenizer, runner)) as client:
        events = parse_sse(
            (
                await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 20, "stream": True})
            ).text
        )
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "injected step failure" in error["message"]
        r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 20})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


async def test_openai_client_raises_on_error_event(tokenizer):
    app = make_app(tokenizer, FakeRunner(fail_at_step=2))
    async with live_server(app) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
            stream = await client.completions.create(model=MODEL, prompt="p", max_tokens=20, stream=True)
            with pytest.raises(openai.APIError, match="injected step failure"):
                async for _ in stream:
                    pass
