"""The HTTP API over ASGI with the real AsyncEngine and a fake runner: shapes, streaming, stop strings,
n > 1, logprobs, echo, tokenize, metrics, and what happens when the engine fails."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fakes import FakeRunner, fake_loader, live_server, parse_sse, running_app, wait_until

from server.app import create_app
from server.config import ServerConfig
from server.tokenizer import ServerTokenizer

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir) -> ServerTokenizer:
    return ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


def make_app(tokenizer: ServerTokenizer, runner: FakeRunner | None = None, **config):
    return create_app(ServerConfig(model=MODEL, **config), fake_loader(tokenizer, runner or FakeRunner()))


@pytest.fixture
async def client(tokenizer):
    async with running_app(make_app(tokenizer)) as c:
        yield c


def joined(events: list, index: int = 0, key: str = "text") -> str:
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        for ch in e["choices"]:
            if ch["index"] == index:
                out.append(ch["delta"].get("content", "") if key == "content" else ch["text"])
    return "".join(out)


def finish_reasons(events: list) -> dict[int, str]:
    return {
        ch["index"]: ch["finish_reason"]
        for e in events
        if e != "[DONE]"
        for ch in e["choices"]
        if ch["finish_reason"]
    }


# --- completions ---


async def test_completion_shape(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == MODEL
    assert body["system_fingerprint"]
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


@pytest.mark.parametrize(
    ("prompt", "num_prompts"),
    [("one", 1), (["one", "two"], 2), ([520, 9531, 198], 1), ([[520, 9531], [198, 33, 44]], 2)],
)
async def test_completion_prompt_forms(client, prompt, num_prompts):
    r = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(2 * num_prompts))
    # Greedy: the n choices of one prompt agree; choices of different prompts follow their own prompt.
    for p in range(num_prompts):
        assert choices[2 * p]["text"] == choices[2 * p + 1]["text"]
    assert r.json()["usage"]["completion_tokens"] == 3 * 2 * num_prompts


async def test_model_may_be_omitted(client):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


async def test_stream_equals_non_stream(client):
    req = {"prompt": "The sky is", "max_tokens": 12, "temperature": 0}
    full = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    r = await client.post("/v1/completions", json={**req, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" and e["id"].startswith("cmpl-") for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1
    assert joined(events) == full
    assert finish_reasons(events) == {0: "length"}
    assert "usage" not in events[0]


async def test_stream_include_usage(client):
    r = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = parse_sse(r.text)
    last = events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in events[:-2])


async def test_seed_reproducible_and_n_choices_differ(client):
    req = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 3}
    a = (await client.post("/v1/completions", json=req)).json()["choices"]
    b = (await client.post("/v1/completions", json=req)).json()["choices"]
    assert [c["text"] for c in a] == [c["text"] for c in b]
    assert len({c["text"] for c in a}) == 3  # seed + i per choice, not one seed for all


async def test_n_streams_interleave_with_indices(client):
    req = {"prompt": "x", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7}
    full = (await client.post("/v1/completions", json=req)).json()["choices"]
    events = parse_sse((await client.post("/v1/completions", json={**req, "stream": True})).text)
    assert finish_reasons(events) == {0: "length", 1: "length", 2: "length"}
    for i in range(3):
        assert joined(events, i) == full[i]["text"]


async def test_completion_logprobs_shape(client):
    r = await client.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "logprobs": 3, "temperature": 0}
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == n
    )
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert isinstance(top, dict) and 1 <= len(top) <= 4 and token in top
    # text_offset points at each token's text inside the choice's text.
    offsets = [*lp["text_offset"], len(choice["text"])]
    for i, token in enumerate(lp["tokens"]):
        assert choice["text"][offsets[i] : offsets[i + 1]] == token


async def test_completion_logprobs_stream_match(client):
    req = {"prompt": "Hi", "max_tokens": 6, "logprobs": 2, "temperature": 0}
    full = (await client.post("/v1/completions", json=req)).json()["choices"][0]["logprobs"]
    events = parse_sse((await client.post("/v1/completions", json={**req, "stream": True})).text)
    tokens, offsets = [], []
    for e in events[:-1]:
        for ch in e["choices"]:
            tokens += ch["logprobs"]["tokens"]
            offsets += ch["logprobs"]["text_offset"]
    assert tokens == full["tokens"] and offsets == full["text_offset"]


async def test_echo(client):
    r = await client.post("/v1/completions", json={"prompt": "Echo me", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("Echo me")
    r = await client.post("/v1/completions", json={"prompt": "Echo me", "max_tokens": 0, "echo": True})
    body = r.json()
    assert body["choices"][0]["text"] == "Echo me" and body["usage"]["completion_tokens"] == 0
    events = parse_sse(
        (
            await client.post(
                "/v1/completions", json={"prompt": "Echo me", "max_tokens": 2, "echo": True, "stream": True}
            )
        ).text
    )
    assert joined(events).startswith("Echo me")


# --- chat ---


async def test_chat_shape(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


async def test_chat_max_completion_tokens_and_default(client):
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    # No limit given: as many as fit (the fake never emits EOS), finishing on "length".
    r = await client.post("/v1/chat/completions", json={"messages": CHAT})
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 512 and r.json()["choices"][0]["finish_reason"] == "length"


async def test_chat_content_parts_and_developer_role(client, tokenizer):
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    r = await client.post("/tokenize", json={"messages": msgs})
    expected = tokenizer.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    )
    assert r.json()["tokens"] == expected
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)


async def test_chat_stream(client):
    req = {"messages": CHAT, "max_tokens": 7, "temperature": 0, "n": 2}
    full = (await client.post("/v1/chat/completions", json=req)).json()["choices"]
    r = await client.post(
        "/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in chunks)
    firsts = {}
    for e in chunks:
        for ch in e["choices"]:
            firsts.setdefault(ch["index"], ch["delta"])
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert finish_reasons(events) == {0: "length", 1: "length"}
    for i in range(2):
        assert joined(events, i, "content") == full[i]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 14


async def test_chat_logprobs_shape(client, tokenizer):
    r = await client.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(item["bytes"]).decode() == item["token"]
        assert len(item["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])
    text = r.json()["choices"][0]["message"]["content"]
    assert "".join(i["token"] for i in content) == text
    # logprobs without top_logprobs: the chosen token's logprob only.
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": True})
    assert all(i["top_logprobs"] == [] for i in r.json()["choices"][0]["logprobs"]["content"])


# --- stop strings and text ---


async def scripted_client(tokenizer, text: str, **runner_kwargs):
    runner = FakeRunner(script=tokenizer.encode(text, add_special_tokens=False), **runner_kwargs)
    return running_app(make_app(tokenizer, runner))


def assert_never_emits_stop_prefix(events: list, stops: list[str]) -> None:
    """A stream never shows a prefix of a stop string that it later completes."""
    text = ""
    for e in events[:-1]:
        for ch in e["choices"]:
            text += ch.get("text") or ch.get("delta", {}).get("content", "")
            assert not any(s in text for s in stops)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("world", "Hello "),  # one token
        ("lo wor", "Hel"),  # split across two tokens
        (["d. T", "zzz"], "Hello worl"),  # across three tokens; the other never matches
        ("world!", "Hello world. The end is near."),  # a held-back prefix that never completes
    ],
)
async def test_stop_strings(tokenizer, stop, expected):
    text = "Hello world. The end is near."
    n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    async with await scripted_client(tokenizer, text) as client:
        req = {"prompt": "p", "max_tokens": n_tokens, "stop": stop}
        body = (await client.post("/v1/completions", json=req)).json()
        assert body["choices"][0]["text"] == expected
        matched = expected != text
        assert body["choices"][0]["finish_reason"] == ("stop" if matched else "length")
        events = parse_sse((await client.post("/v1/completions", json={**req, "stream": True})).text)
        assert joined(events) == expected
        stops = [stop] if isinstance(stop, str) else stop
        assert_never_emits_stop_prefix(events, stops)
        chat = (await client.post("/v1/chat/completions", json={"messages": CHAT, **req})).json()
        assert chat["choices"][0]["message"]["content"] == expected


async def test_stop_string_frees_the_request(tokenizer):
    runner = FakeRunner(script=tokenizer.encode("a b c STOP d e f g h i j k", add_special_tokens=False))
    app = make_app(tokenizer, runner)
    async with running_app(app) as client:
        body = (
            await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 200, "stop": " STOP"})
        ).json()
        assert body["choices"][0] == {"index": 0, "text": "a b c", "logprobs": None, "finish_reason": "stop"}
        assert body["usage"]["completion_tokens"] < 10  # finish() ended it; it did not run to max_tokens
        engine = app.state.server.engine
        await wait_until(lambda: engine.stats().running == 0 and engine.stats().kv_blocks_used == 0)
        assert engine.stats().waiting == 0


async def test_multibyte_text_streams_whole_characters(tokenizer):
    text = "Grüße, 你好世界 🎉🚀 café ñandú"
    async with await scripted_client(tokenizer, text) as client:
        n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        req = {"prompt": "p", "max_tokens": n_tokens}
        events = parse_sse((await client.post("/v1/completions", json={**req, "stream": True})).text)
        pieces = [ch["text"] for e in events[:-1] for ch in e["choices"]]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
        body = (await client.post("/v1/completions", json={**req, "logprobs": 0})).json()
        assert body["choices"][0]["text"] == text
        # Tokens that are part of a character read as bytes:..., as OpenAI reports them.
        assert any(t.startswith("bytes:\\x") for t in body["choices"][0]["logprobs"]["tokens"])


async def test_eos_ends_with_stop_and_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    runner = FakeRunner(script=[*ids, 1, *ids, 2])  # 1 = <|im_start|> (special, not EOS), 2 = EOS
    async with running_app(make_app(tokenizer, runner)) as client:
        body = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 50})).json()
        assert body["choices"][0]["text"] == "Hi thereHi there"
        assert body["choices"][0]["finish_reason"] == "stop"
        body = (
            await client.post(
                "/v1/completions", json={"prompt": "p", "max_tokens": 50, "skip_special_tokens": False}
            )
        ).json()
        assert body["choices"][0]["text"] == "Hi there<|im_start|>Hi there<|im_end|>"


# --- engine failure ---


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


# --- the other routes ---


async def test_models_health_tokenize_detokenize(client, tokenizer):
    r = await client.get("/v1/models")
    [card] = r.json()["data"]
    assert r.json()["object"] == "list" and card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == 512
    assert (await client.get(f"/v1/models/{MODEL}")).json() == card
    assert (await client.get("/v1/models/other")).json()["error"]["code"] == "model_not_found"
    assert (await client.get("/health")).status_code == 200
    r = await client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.json() == {
        "count": len(tokenizer.encode("Hello world")),
        "max_model_len": 512,
        "tokens": tokenizer.encode("Hello world"),
        "token_strs": None,
    }
    r = await client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


async def test_metrics(client):
    await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:iteration_tokens_total_bucket",
    ):
        assert name in text, name
    assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 3.0' in text
    prompt_tokens = len((await client.post("/tokenize", json={"prompt": "Hello"})).json()["tokens"])
    assert f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {float(prompt_tokens)}' in text
    assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} 1.0' in text


async def test_two_apps_in_one_process_keep_separate_metrics(tokenizer):
    async with running_app(make_app(tokenizer)) as a, running_app(make_app(tokenizer)) as b:
        await a.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 2.0' in (await a.get("/metrics")).text
        assert "vllm:generation_tokens_total{" not in (await b.get("/metrics")).text


@pytest.mark.parametrize(
    ("scheduling", "kv_policy"), [("request", "reserve"), ("iteration", "reserve"), ("request", "lazy")]
)
async def test_scheduler_flags_are_wired(tokenizer, scheduling, kv_policy):
    app = make_app(tokenizer, FakeRunner(), scheduling=scheduling, kv_policy=kv_policy, max_num_seqs=2)
    async with running_app(app) as client:
        rs = await asyncio.gather(
            *(client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3 + i}) for i in range(5))
        )
        assert [r.json()["usage"]["completion_tokens"] for r in rs] == [3, 4, 5, 6, 7]
        engine = app.state.server.engine
        assert (engine.config.scheduling, engine.config.kv_policy, engine.config.max_num_seqs) == (
            scheduling,
            kv_policy,
            2,
        )
