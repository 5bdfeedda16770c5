"""The OpenAI API over ASGI with the real IterationLoop and the fake runner: response shapes of both
endpoints, streaming, n > 1, logprobs, echo, whole UTF-8 characters, the utility routes, scheduler flags."""

from __future__ import annotations

import asyncio

import pytest
from fakes import (
    MODEL,
    FakeRunner,
    error_of,
    finish_reasons,
    joined,
    make_app,
    parse_sse,
    running_app,
    scripted_client,
)

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture
async def client(tokenizer):
    async with running_app(make_app(tokenizer)) as c:
        yield c


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


async def test_multibyte_text_streams_whole_characters(tokenizer):
    text = "Grüße, 你好世界 🎉🚀 café ñandú"
    async with scripted_client(tokenizer, text) as client:
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
        engine = app.state.server.loop
        assert (engine.config.scheduling, engine.config.kv_policy, engine.config.max_num_seqs) == (
            scheduling,
            kv_policy,
            2,
        )


async def test_flags_raise_the_caps_as_well_as_lower_them(tokenizer):
    """--max-logprobs, --max-stop-strings and --max-n decide; OpenAI's own caps (20, 4, 128) are only
    the defaults' neighbours, not hidden limits."""
    app = make_app(tokenizer, max_logprobs=30, max_stop_strings=6, max_n=200, max_choices=200)
    async with running_app(app) as client:
        body = {"prompt": "hi", "max_tokens": 2, "logprobs": 25, "stop": [f"s{i}" for i in range(6)]}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 25
        chat = {"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 30}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        many = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 150})
        assert many.status_code == 200 and len(many.json()["choices"]) == 150
        over = await client.post("/v1/completions", json={**body, "logprobs": 31})
        assert error_of(over)["param"] == "logprobs"
