"""The whole stack (server -> IterationLoop -> LocalExecutor -> tiny random Llama) over real sockets:
concurrency, seeds, logprobs, stop strings, client disconnects and the async openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import pytest_asyncio
from fakes import live_server, parse_sse, server_config
from waiting import wait_until

from server.app import create_app
from server.loader import load_served_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny-llama"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_llama_dir):
    """(app, base_url) for the tiny Llama, loaded once for the module."""
    config = server_config(
        model=str(tiny_llama_dir), served_model_name=MODEL, dtype="float32", device="cpu", num_kv_blocks=512
    )
    app = create_app(config, lambda: load_served_model(config))
    async with live_server(app) as url:
        yield app, url


@pytest_asyncio.fixture(loop_scope="module")
async def http(served):
    async with httpx.AsyncClient(base_url=served[1], timeout=120) as client:
        yield client


def loop_of(served):
    return served[0].state.server.loop


def finished_requests(served) -> float:
    registry = served[0].state.server.metrics.registry
    return sum(
        s.value for m in registry.collect() for s in m.samples if s.name == "vllm:request_success_total"
    )


async def idle(served) -> None:
    engine = loop_of(served)
    await wait_until(
        lambda: (
            engine.stats().running == 0 and engine.stats().waiting == 0 and engine.stats().kv_blocks_used == 0
        )
    )


async def stream_text(http: httpx.AsyncClient, path: str, body: dict) -> tuple[str, list]:
    r = await http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    key = "text" if path.endswith("/completions") and "chat" not in path else "content"
    text = "".join(
        ch["text"] if key == "text" else ch["delta"].get("content", "")
        for e in events[:-1]
        for ch in e["choices"]
    )
    return text, events


async def test_32_concurrent_greedy_streams_equal_solo(served, http):
    prompts = [f"Request number {i} says" + " more" * (i % 7) for i in range(32)]
    alone = []
    for p in prompts:  # one at a time: nothing else in the batch
        r = await http.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0})
        alone.append(r.json()["choices"][0]["text"])
    sizes: list[int] = []
    loop_of(served).add_step_listener(lambda report: sizes.append(report.num_seqs))
    together = await asyncio.gather(
        *(
            stream_text(http, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
            for p in prompts
        )
    )
    assert max(sizes) > 1  # they really shared iterations
    assert [t for t, _ in together] == alone
    await idle(served)


async def test_seed_reproducible_on_real_model(http):
    req = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 42,
    }
    a = (await http.post("/v1/chat/completions", json=req)).json()["choices"][0]["message"]["content"]
    b, _ = await stream_text(http, "/v1/chat/completions", req)
    assert a == b


async def test_real_logprobs(http):
    req = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    body = (await http.post("/v1/chat/completions", json=req)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert item["token"] == item["top_logprobs"][0]["token"]  # greedy picks the likeliest
        assert item["logprob"] == pytest.approx(tops[0], abs=1e-4)
    r = await http.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(t) <= 3 for t in lp["top_logprobs"])


async def test_stop_string_on_real_model(http):
    req = {"prompt": "The weather today", "max_tokens": 24, "temperature": 0}
    text = (await http.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    body = (await http.post("/v1/completions", json={**req, "stop": [stop]})).json()
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    streamed, _ = await stream_text(http, "/v1/completions", {**req, "stop": [stop]})
    assert streamed == expected


async def test_stream_disconnect_aborts(served):
    engine = loop_of(served)
    async with httpx.AsyncClient(base_url=served[1], timeout=120) as client:
        async with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Go", "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
            assert engine.stats().running == 1
    # Leaving the block closes the connection mid-stream.
    await idle(served)


async def test_non_stream_disconnect_aborts(served):
    engine = loop_of(served)
    before = finished_requests(served)
    async with httpx.AsyncClient(base_url=served[1], timeout=120) as client:
        task = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "Go", "max_tokens": 450, "ignore_eos": True})
        )
        await wait_until(lambda: engine.stats().running == 1 and engine.stats().kv_blocks_used > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await idle(served)
    assert finished_requests(served) == before  # aborted, never finished


async def test_async_openai_client(served):
    client = openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    c = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
    stream = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, stream=True
    )
    assert "".join([chunk.choices[0].text async for chunk in stream]) == c.choices[0].text
    msgs = [{"role": "user", "content": "Hi"}]
    chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in chat.choices] == [0, 1]
    usage_too = {"include_usage": True}
    stream = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True, stream_options=usage_too
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 6
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=msgs)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100000)
    assert exc.value.code == "context_length_exceeded"
    await client.close()


async def test_metrics_after_traffic(http):
    text = (await http.get("/metrics")).text
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert running and running[0].endswith(" 0.0")
    assert json.dumps(MODEL) in text.replace("'", '"')


async def test_sampling_fields_reach_the_sampler(http):
    forced = 9531  # any ordinary token: a +100 bias makes it the greedy choice every step
    req = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}}
    r = (await http.post("/tokenize", json={"prompt": "x"})).json()
    assert r["max_model_len"] == 512
    body = (await http.post("/v1/completions", json={**req, "logprobs": 0})).json()
    detok = (await http.post("/detokenize", json={"tokens": [forced] * 4})).json()["prompt"]
    assert body["choices"][0]["text"] == detok
    # The same token as a stop token: generation ends after it, with finish_reason "stop".
    body = (await http.post("/v1/completions", json={**req, "stop_token_ids": [forced]})).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1


async def test_stream_disconnect_aborts_all_choices(served):
    async with httpx.AsyncClient(base_url=served[1], timeout=120) as client:
        req = {"prompt": "Go", "max_tokens": 400, "stream": True, "ignore_eos": True, "n": 3}
        async with client.stream("POST", "/v1/completions", json=req) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
    await idle(served)
