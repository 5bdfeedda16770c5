"""Stop strings: the hold-back matcher against a reference, a cut that does not depend on how the text
is chunked, and over the API: no prefix of a stop string is ever emitted, and a match frees the request."""

from __future__ import annotations

import pytest
from fakes import (
    FakeRunner,
    joined,
    make_app,
    parse_sse,
    running_app,
    scripted_client,
    wait_until,
)
from hypothesis import example, given
from hypothesis import strategies as st

from server.stop_strings import StopStringMatcher

CHAT = [{"role": "user", "content": "Say something."}]


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        out.append(m.feed(chunk))
        if m.matched is not None:
            return out, True
    out.append(m.flush())
    return out, m.matched is not None  # flush() acts on a stop that completed under a longer candidate


@given(
    text=st.text(alphabet="abc ", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=4),
)
@example(text=" a", cuts=[1], stops=["a", " aa"])  # "a" completes while " aa" is pending: flush decides
def test_stop_matcher_matches_reference(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, matched = run_matcher(stops, chunks)
    # Reference: cut at the earliest occurrence of any stop string.
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert "".join(out) == expected
    assert matched == bool(hits)
    # Never emitted: a prefix of a stop string that later completes, so the emitted text at every
    # point is a prefix of the final text.
    emitted = ""
    for piece in out:
        emitted += piece
        assert expected.startswith(emitted)


def test_stop_matcher_holds_only_what_may_match():
    m = StopStringMatcher(["</end>"])
    assert m.feed("hello </") == "hello "
    assert m.held == "</"
    assert m.feed("b>") == "</b>"
    assert m.feed("x</en") == "x"
    assert m.feed("d>tail") == "" and m.matched == "</end>"


@pytest.mark.parametrize("chunks", [["aba"], ["ab", "a"], ["a", "b", "a"], ["a", "ba"]])
def test_stop_cut_is_the_same_for_every_chunking(chunks):
    from server.stop_strings import StopStringMatcher

    m = StopStringMatcher(["b", "aba"])
    out = "".join(m.feed(c) for c in chunks)
    assert (out, m.matched) == ("", "aba")  # "aba" starts first, though "b" completes first


def test_stop_that_completed_while_a_longer_one_was_pending_is_applied_at_the_end():
    from server.stop_strings import StopStringMatcher

    m = StopStringMatcher(["b", "aba"])
    assert m.feed("ab") == "" and m.matched is None  # "aba" may still come
    assert m.flush() == "a" and m.matched == "b"  # the text ended: "b" it is


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
        assert body["usage"]["completion_tokens"] < 10  # finish() ended it; it did not run to max_tokens
        engine = app.state.server.loop
        await wait_until(lambda: engine.stats().running == 0 and engine.stats().kv_blocks_used == 0)
        assert engine.stats().waiting == 0
