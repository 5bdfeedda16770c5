"""/v1/messages and /v1/messages/count_tokens with the official anthropic client (messages.create,
messages.stream, count_tokens) and raw HTTP, over the fake runner: the message object, stop reasons
(stop sequences included), the event stream, tools with a tool_use / tool_result round trip, cut tool
calls, thinking blocks, Anthropic's error shape and its x-api-key header."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from fakes import (
    MODEL,
    FakeRunner,
    RecordingRunner,
    assert_hanging_up_frees_the_request,
    live_server,
    make_app,
    parse_sse,
    running_app,
    scripted,
)
from pydantic_core import from_json

GREETING = "Hello there, friend."
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


def sdk(url: str, **kwargs) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs
    )


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


async def test_create_and_stop_reasons(tokenizer):
    app = make_app(tokenizer, scripted(tokenizer, GREETING))
    async with live_server(app) as url, sdk(url) as client:
        m = await client.messages.create(model=MODEL, max_tokens=50, messages=USER, system="Be brief.")
        assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == GREETING
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        assert m.usage.output_tokens == len(tokenizer.encode(GREETING, add_special_tokens=False)) + 1
        cut = await client.messages.create(model=MODEL, max_tokens=2, messages=USER)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
        stopped = await client.messages.create(
            model=MODEL, max_tokens=50, messages=USER, stop_sequences=["zzz", "friend"]
        )
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "friend"
        assert stopped.content[0].text == "Hello there, "
        # The prefix cache served the repeated prompt: a cache read, apart from input_tokens.
        again = await client.messages.create(model=MODEL, max_tokens=50, messages=USER, system="Be brief.")
        assert again.usage.cache_read_input_tokens > 0
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens == m.usage.input_tokens


async def test_stream_events_and_final_message(tokenizer):
    app = make_app(tokenizer, scripted(tokenizer, GREETING))
    async with live_server(app) as url, sdk(url) as client:
        async with client.messages.stream(
            model=MODEL, max_tokens=50, messages=USER, stop_sequences=["friend"]
        ) as s:
            text = "".join([t async for t in s.text_stream])
            final = await s.get_final_message()
        assert text == "Hello there, " and final.content[0].text == text
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "friend"
    async with running_app(make_app(tokenizer, scripted(tokenizer, GREETING))) as raw:
        r = await raw.post(
            "/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": USER, "stream": True}
        )
        events = parse_sse(r.text)
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        kinds = [e["type"] for e in events]
        assert names == kinds and "[DONE]" not in events
        deltas = kinds.count("content_block_delta")
        assert kinds == [
            "message_start",
            "ping",
            "content_block_start",
            *["content_block_delta"] * deltas,
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
        assert (
            events[-2]["usage"]["output_tokens"]
            == len(tokenizer.encode(GREETING, add_special_tokens=False)) + 1
        )


async def test_tool_use_round_trip(tokenizer):
    runner = RecordingRunner(script=[*tokenizer.encode(CALL, add_special_tokens=False), 2])
    app = make_app(tokenizer, runner)
    async with live_server(app) as url, sdk(url) as client:
        force = {"type": "tool", "name": "get_weather"}
        m = await client.messages.create(
            model=MODEL, max_tokens=80, messages=USER, tools=[WEATHER], tool_choice=force
        )
        (use,) = m.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        assert use.id.startswith("toolu_") and m.stop_reason == "tool_use"
        history = [
            *USER,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
            },
        ]
        follow = await client.messages.create(model=MODEL, max_tokens=80, messages=history, tools=[WEATHER])
        prompt = tokenizer.decode(runner.prompts[f"{follow.id}-0"])
        assert "Sunny, 21 C" in prompt and "get_weather" in prompt
        async with client.messages.stream(
            model=MODEL, max_tokens=80, messages=USER, tools=[WEATHER], tool_choice={"type": "any"}
        ) as s:
            final = await s.get_final_message()
        assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"
        # A tool_result for a tool_use nobody made is refused in Anthropic's shape.
        orphan = [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}
        ]
        with pytest.raises(anthropic.BadRequestError) as exc:
            await client.messages.create(model=MODEL, max_tokens=8, messages=orphan)
        assert exc.value.body["error"]["type"] == "invalid_request_error" and "toolu_x" in exc.value.message


async def test_a_cut_tool_call_is_returned_as_far_as_it_went(tokenizer):
    app = make_app(tokenizer, scripted(tokenizer, CALL))
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    cut = next(
        n for n in range(len(ids)) if '"city": "Pa' in tokenizer.decode(ids[:n])
    )  # inside the arguments
    body = {"max_tokens": cut, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    async with live_server(app) as url, sdk(url) as client:
        m = await client.messages.create(model=MODEL, **body)
        (use,) = m.content
        assert m.stop_reason == "max_tokens" and use.type == "tool_use" and use.name == "get_weather"
        written = tokenizer.decode(ids[:cut])
        arguments = written.split('"arguments": ', 1)[1]  # the arguments as far as they went
        assert arguments and '{"city": "Paris"}'.startswith(arguments)
        assert use.input == from_json(arguments, allow_partial="trailing-strings")
        async with client.messages.stream(model=MODEL, **body) as s:
            final = await s.get_final_message()
        # The SDK reads the streamed input_json_delta pieces itself (dropping an unfinished string).
        assert final.stop_reason == "max_tokens" and final.content[0].name == "get_weather"
    async with running_app(make_app(tokenizer, scripted(tokenizer, CALL))) as raw:
        events = parse_sse(
            (await raw.post("/v1/messages", json={"model": MODEL, "stream": True, **body})).text
        )
        partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
        assert partial == arguments and events[-2]["delta"]["stop_reason"] == "max_tokens"


async def test_thinking_blocks(thinking_tokenizer):
    reply = "<think>Two and two.</think>It is 4."
    app = make_app(thinking_tokenizer, scripted(thinking_tokenizer, reply), reasoning_parser="qwen3")
    async with live_server(app) as url, sdk(url) as client:
        m = await client.messages.create(model=MODEL, max_tokens=64, messages=USER)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
            ("thinking", "Two and two."),
            ("text", "It is 4."),
        ]
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as s:
            events = [e async for e in s]
            final = await s.get_final_message()
        thinking = "".join(
            e.delta.thinking
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        )
        assert thinking == "Two and two." and final.content[1].text == "It is 4."
        # thinking disabled: the template closes the thinking itself, so the whole reply is text.
        off = await client.messages.create(
            model=MODEL, max_tokens=64, messages=USER, thinking={"type": "disabled"}
        )
        assert [b.type for b in off.content] == ["text"] and off.content[0].text == reply
        # Earlier thinking goes back to the template with its turn.
        turn = [
            *USER,
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": "Sure?"},
        ]
        follow = await client.messages.create(model=MODEL, max_tokens=64, messages=turn)
        assert follow.stop_reason == "end_turn"


async def test_count_tokens_matches_the_prompt(tokenizer):
    async with live_server(make_app(tokenizer, scripted(tokenizer, GREETING))) as url, sdk(url) as client:
        kwargs = {"messages": USER, "system": [{"type": "text", "text": "Be brief."}], "tools": [WEATHER]}
        count = await client.messages.count_tokens(model=MODEL, **kwargs)
        m = await client.messages.create(model=MODEL, max_tokens=8, **kwargs)
        assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


async def test_errors_take_anthropics_shape(tokenizer):
    async with running_app(make_app(tokenizer, scripted(tokenizer, GREETING))) as client:
        msg = anthropic_error(
            await client.post("/v1/messages", json={"model": MODEL, "messages": USER}),
            400,
            "invalid_request_error",
        )
        assert "max_tokens" in msg
        image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
        msg = anthropic_error(
            await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": image}),
            400,
            "invalid_request_error",
        )
        assert "image" in msg
        server_tool = {"type": "web_search_20250305", "name": "web_search"}
        body = {"model": MODEL, "max_tokens": 5, "messages": USER, "tools": [server_tool]}
        assert "web_search" in anthropic_error(
            await client.post("/v1/messages", json=body), 400, "invalid_request_error"
        )
        body = {"model": "claude-x", "max_tokens": 5, "messages": USER}
        anthropic_error(await client.post("/v1/messages", json=body), 404, "not_found_error")
        body = {"model": MODEL, "max_tokens": 10**6, "messages": USER}
        assert "context length" in anthropic_error(
            await client.post("/v1/messages", json=body), 400, "invalid_request_error"
        )
        anthropic_error(
            await client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"}),
            400,
            "invalid_request_error",
        )
        # The OpenAI routes keep OpenAI's shape.
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and set(r.json()) == {"error"}


async def test_api_key_as_x_api_key_or_bearer(tokenizer):
    app = make_app(tokenizer, scripted(tokenizer, GREETING), api_key="sekret")
    async with running_app(app) as client:
        body = {"model": MODEL, "max_tokens": 5, "messages": USER}
        msg = anthropic_error(await client.post("/v1/messages", json=body), 401, "authentication_error")
        assert "x-api-key" in msg
        anthropic_error(
            await client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}),
            401,
            "authentication_error",
        )
        assert (
            await client.post("/v1/messages", json=body, headers={"x-api-key": "sekret"})
        ).status_code == 200
        assert (
            await client.post("/v1/messages", json=body, headers={"authorization": "Bearer sekret"})
        ).status_code == 200
        r = await client.post(
            "/v1/chat/completions", json={"messages": USER}, headers={"x-api-key": "sekret"}
        )
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 401 and set(r.json()) == {"error"}
    async with live_server(make_app(tokenizer, scripted(tokenizer, GREETING), api_key="sekret")) as url:
        async with sdk(url, api_key="sekret") as client:
            assert (await client.messages.create(model=MODEL, max_tokens=5, messages=USER)).content
        async with sdk(url, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError):
                await client.messages.create(model=MODEL, max_tokens=5, messages=USER)


async def test_client_gone_mid_stream_frees_its_request(tokenizer):
    body = {"model": MODEL, "max_tokens": 300, "messages": USER, "stream": True}
    await assert_hanging_up_frees_the_request(tokenizer, "/v1/messages", body, "text_delta")


async def test_engine_failure_mid_stream_ends_with_an_error_event(tokenizer):
    runner = FakeRunner(script=tokenizer.encode(GREETING * 4, add_special_tokens=False), fail_at_step=3)
    async with running_app(make_app(tokenizer, runner)) as client:
        body = {"model": MODEL, "max_tokens": 50, "messages": USER}
        events = parse_sse((await client.post("/v1/messages", json={**body, "stream": True})).text)
        assert events[0]["type"] == "message_start"
        assert events[-1] == {
            "type": "error",
            "error": {"type": "api_error", "message": events[-1]["error"]["message"]},
        }
        assert "injected" in events[-1]["error"]["message"] or events[-1]["error"]["message"]
        anthropic_error(await client.post("/v1/messages", json=body), 500, "api_error")
