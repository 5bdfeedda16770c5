"""Bodies a careless or hostile client sends: over the size limit (with and without Content-Length),
malformed JSON, NaN and Infinity, garbage requests, unknown fields."""

from __future__ import annotations

import logging

import pytest
from fakes import (
    FakeRunner,
    error_of,
    make_app,
    running_app,
)

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(tokenizer):
    async with running_app(make_app(tokenizer, FakeRunner(max_model_len=256), max_body_bytes=4096)) as c:
        yield c


async def test_body_over_limit_is_413(client):
    big = {"prompt": "x" * 5000}
    assert error_of(await client.post("/v1/completions", json=big), 413)["code"] == "payload_too_large"

    async def chunked():  # no Content-Length: the limit is applied while the body arrives
        for _ in range(10):
            yield b"[" + b"1," * 500

    err = error_of(await client.post("/v1/completions", content=chunked()), 413)
    assert err["code"] == "payload_too_large"
    r = await client.post("/v1/completions", content=b"{}", headers={"content-length": "abc"})
    assert r.status_code in (400, 413)


BAD_BODIES = [
    (b'{"prompt": "hi", ', None),  # truncated JSON
    (b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
    (b"[1, 2, 3]", None),  # an array, not an object
    (b'"just a string"', None),
    (b"", None),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": "warm"}', "temperature"),
    (b'{"prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias.5"),
]


@pytest.mark.parametrize(("raw", "param"), BAD_BODIES)
async def test_malformed_bodies_are_400(client, raw, param):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


BAD_COMPLETIONS = [
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "max_tokens": -5},
    {"prompt": "hi", "max_tokens": 10**12},
    {"prompt": "hi", "max_tokens": 10**30},
    {"prompt": "hi", "n": 10**9},
    {"prompt": "hi", "n": 17},  # over the server's max_n (16)
    {"prompt": ["a"] * 20, "n": 4},  # 80 choices > max_choices (64)
    {"prompt": [0, 49152]},  # one past the vocabulary
    {"prompt": [-1, 5]},
    {"prompt": [[5], [10**9]]},
    {"prompt": "hi", "stop_token_ids": [10**6]},
    {"prompt": "hi", "logit_bias": {"10000000": 1}},
    {"prompt": "hi", "logprobs": 10**6},
    {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "hi", "model": "/etc/passwd"},
    {"prompt": "hi", "model": "../../models/other"},
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS)
async def test_bad_completion_requests_are_4xx(client, body):
    r = await client.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500
    error_of(r, r.status_code)


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"content": "hi"}]},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}]},
    {"messages": CHAT, "max_tokens": 0},
    {"messages": CHAT, "max_completion_tokens": -1},
    {"messages": CHAT, "n": 100},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 99},
    {"messages": CHAT, "temperature": "hot"},
    {"messages": CHAT, "model": "/tmp/evil.gguf"},
]


@pytest.mark.parametrize("body", BAD_CHATS)
async def test_bad_chat_requests_are_4xx(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500
    error_of(r, r.status_code)


async def test_unknown_fields_are_ignored_and_logged_once(client, caplog):
    body = {"prompt": "hi", "max_tokens": 1, "frobnicate_xyz": True, "stream_options_typo": 1}
    with caplog.at_level(logging.WARNING, logger="server.protocol"):
        for _ in range(3):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "frobnicate_xyz" in r.getMessage()]
    assert len(lines) == 1 and "ignoring unknown field" in lines[0]


# A lone UTF-16 surrogate is a valid JSON escape but not Unicode text: each API answers 400 naming the
# field, in its own shape (before, the tokenizer raised inside the route: a 500).
LONE_SURROGATES = [
    ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\uDFFF"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "user": "\\ude00"}', "user"),
    ("/v1/responses", b'{"input": "x \\udbff"}', "input"),
    ("/v1/embeddings", b'{"input": ["a", "b\\ud800"]}', "input[1]"),
    ("/v1/messages", b'{"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', "messages[0].content[0].text"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "param"), LONE_SURROGATES)
async def test_lone_surrogates_are_400_naming_the_field(client, path, raw, param):
    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    if path == "/v1/messages":  # Anthropic's shape
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert param in body["error"]["message"]
    else:
        err = error_of(r, 400)
        assert (err["param"], err["code"]) == (param, "invalid_unicode")


async def test_escaped_surrogate_pairs_and_escaped_backslashes_are_text(client):
    # An emoji escaped as its surrogate pair (json.dumps' default) is one character; "\\ud800" with its
    # backslash escaped is six plain characters.
    for raw in (
        b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 1}',
        b'{"prompt": "\\\\ud800", "max_tokens": 1}',
    ):
        r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
