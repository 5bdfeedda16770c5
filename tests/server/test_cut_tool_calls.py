"""A tool call cut by the token limit is returned as far as it went, with finish_reason "length", streamed
or not (issue #27): never dropped, and never handed back as answer text. The fake runner's script is
the reply a tool_choice grammar would have forced (the masks themselves are tested in tests/engine)."""

from __future__ import annotations

import pytest
from fakes import WEATHER_TOOL, make_app, parse_sse, running_app, scripted

WEATHER = WEATHER_TOOL
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}]}'
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _cut_after(tokenizer, text: str, prefix: str) -> int:
    """How many tokens of `text` cover `prefix` (max_tokens that cuts the reply right after it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n in range(len(ids) + 1):
        if tokenizer.decode(ids[:n]).startswith(prefix):
            return n
    raise AssertionError(prefix)


@pytest.mark.parametrize(
    "prefix, choice, name, args",
    [
        # Cut inside the arguments: the call with the arguments written so far.
        ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris', "required", "get_weather",
         '{"city": "Paris'),
        # Cut after the name, before the arguments: the call, with none.
        ('{"tool_calls": [{"name": "get_weather",', "required", "get_weather", ""),
        # Cut inside the name: a named tool_choice already says whose call it is.
        ('{"tool_calls": [{"na', NAMED, "get_weather", ""),
    ],
)  # fmt: skip
async def test_chat_returns_a_cut_call(tokenizer, prefix, choice, name, args):
    max_tokens = _cut_after(tokenizer, CALL, prefix)
    async with running_app(make_app(tokenizer, scripted(tokenizer, CALL))) as client:
        body = {"messages": USER, "tools": [WEATHER], "tool_choice": choice, "max_tokens": max_tokens}
        choice0 = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice0["finish_reason"] == "length" and choice0["message"]["content"] is None
        (call,) = choice0["message"]["tool_calls"]
        assert call["function"]["name"] == name and call["function"]["arguments"].startswith(args)
        events = parse_sse((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        deltas = [e["choices"][0] for e in events if e != "[DONE]"]
        assert deltas[-1]["finish_reason"] == "length"
        pieces = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [p["function"]["name"] for p in pieces if "id" in p] == [name]
        assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
