"""Stop strings over the API: the text is cut before the earliest one, streamed or not, no prefix of a
stop string is ever emitted, and a match ends the request in the step that completed it. (The matcher
itself is tested in tests/scheduler/test_stop.py.)"""

from __future__ import annotations

import pytest
from fakes import FakeRunner, joined, make_app, parse_sse, running_app, scripted_client

CHAT = [{"role": "user", "content": "Say something."}]


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
    async with scripted_client(tokenizer, text) as client:
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
        # It ended at the token that completed " STOP", whose step also freed its blocks: both before
        # the final delta, so before the response. (With overlapped scheduling the step after it was
        # scheduled before that token was known: it may run the request's row for nothing.)
        stopped_at = len(tokenizer.encode("a b c STOP", add_special_tokens=False))
        assert body["usage"]["completion_tokens"] == stopped_at
        assert runner.num_steps in (stopped_at, stopped_at + 1)
        stats = app.state.server.loop.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


async def test_stop_string_logprobs_cover_the_emitted_text(tokenizer):
    text = "Hello world. The end is near."
    async with scripted_client(tokenizer, text) as client:
        req = {"prompt": "p", "max_tokens": 20, "stop": "d. T", "logprobs": 1}
        body = (await client.post("/v1/completions", json=req)).json()
        choice = body["choices"][0]
        assert choice["text"] == "Hello worl" and choice["finish_reason"] == "stop"
        # Every token whose text starts before the cut (the one that holds "worl" included), no more.
        ids = tokenizer.encode(text, add_special_tokens=False)
        starts = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
        kept = [i for i, start in enumerate(starts) if start < len("Hello worl")]
        tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        assert tokens == [tokenizer.token_text(ids[i]) for i in kept] and offsets == [starts[i] for i in kept]
        assert len(kept) < len(ids) - 1  # the tokens of the stop string are not reported
        events = parse_sse((await client.post("/v1/completions", json={**req, "stream": True})).text)
        streamed = [
            t
            for e in events
            if e != "[DONE]"
            for c in e["choices"]
            if c["logprobs"]
            for t in c["logprobs"]["tokens"]
        ]
        assert streamed == tokens
