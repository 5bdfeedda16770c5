"""/v1/responses with the official openai client (responses.create, responses.stream, retrieve, delete,
cancel) and raw HTTP, over the fake runner: the response object, the typed event sequence, function
tools, input items, text.format, storage and continuation (the prompt extends the previous one), store
bounds, background runs, cut replies, reasoning items, and the errors' shapes."""

from __future__ import annotations

import json

import openai
import pytest
from fakes import (
    MODEL,
    FakeRunner,
    RecordingRunner,
    assert_hanging_up_frees_the_request,
    drained,
    error_of,
    live_server,
    make_app,
    parse_sse,
    running_app,
    scripted,
    wait_until,
)

from server.responses_api.store import ResponseStore

GREETING = "Hello there, friend."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


def app_for(tokenizer, text: str = GREETING, runner: FakeRunner | None = None, **config):
    runner = runner or scripted(tokenizer, text)
    return make_app(tokenizer, runner, **config)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_create_retrieve_delete_with_the_sdk(tokenizer):
    app = app_for(tokenizer)
    async with live_server(app) as url, sdk(url) as client:
        r = await client.responses.create(
            model=MODEL, input="Hi", instructions="Be brief.", metadata={"k": "v"}
        )
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
        assert r.output_text == GREETING and r.instructions == "Be brief." and r.metadata == {"k": "v"}
        (message,) = r.output
        assert message.type == "message" and message.role == "assistant" and message.status == "completed"
        assert r.usage.output_tokens == len(tokenizer.encode(GREETING, add_special_tokens=False)) + 1
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert (
            r.usage.input_tokens_details.cached_tokens == 0
            and r.usage.output_tokens_details.reasoning_tokens == 0
        )
        got = await client.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump()
        await client.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(r.id)
        unstored = await client.responses.create(model=MODEL, input="Hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)


async def test_stream_sends_the_typed_event_sequence(tokenizer):
    app = app_for(tokenizer)
    async with live_server(app) as url, sdk(url) as client:
        async with client.responses.stream(model=MODEL, input="Hi") as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        deltas = kinds.count("response.output_text.delta")
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * deltas,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == GREETING
        assert final.output_text == GREETING and final.status == "completed"
        assert (await client.responses.retrieve(final.id)).output_text == GREETING
    async with running_app(app_for(tokenizer)) as raw:
        r = await raw.post("/v1/responses", json={"input": "Hi", "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        events = parse_sse(r.text)
        assert names == [e["type"] for e in events] and "[DONE]" not in events  # each event named, no [DONE]


async def test_function_tools_forced_streamed_and_not(tokenizer):
    app = app_for(tokenizer, CALL)
    async with live_server(app) as url, sdk(url) as client:
        r = await client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        )
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
        assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
        async with client.responses.stream(
            model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required"
        ) as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        # A forced call writes no text: text.format does not stand in its way (the Agents SDK sends both).
        fmt = {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}}
        both = await client.responses.create(
            model=MODEL, input="W?", tools=[WEATHER], tool_choice="required", text=fmt
        )
        assert both.output[0].type == "function_call"
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args == done.arguments == final.output[0].arguments and json.loads(args) == {"city": "Paris"}


async def test_input_items_and_their_errors(tokenizer):
    async with running_app(app_for(tokenizer)) as client:
        turn = [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask it."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "And tomorrow?"},
        ]  # fmt: skip
        r = await client.post("/v1/responses", json={"input": turn, "tools": [WEATHER]})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == GREETING
        orphan = [{"type": "function_call_output", "call_id": "call_9", "output": "?"}]
        err = error_of(await client.post("/v1/responses", json={"input": orphan}))
        assert err["param"] == "input" and "call_9" in err["message"]
        image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
        err = error_of(await client.post("/v1/responses", json={"input": image}))
        assert err["param"].startswith("input") and "input_image" in err["message"]
        err = error_of(
            await client.post("/v1/responses", json={"input": [{"type": "computer_call", "id": "x"}]})
        )
        assert err["param"] == "input" and "computer_call" in err["message"]
        err = error_of(
            await client.post("/v1/responses", json={"input": "Hi", "tools": [{"type": "web_search"}]})
        )
        assert err["param"] == "tools" and "web_search" in err["message"]
        err = error_of(await client.post("/v1/responses", json={"input": "Hi", "tools": 5}))  # not a list
        assert err["param"] == "tools"
        err = error_of(await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 10**6}))
        assert err["code"] == "context_length_exceeded"
        err = error_of(await client.post("/v1/responses", json={"input": "Hi", "top_logprobs": 2}))
        assert err["param"] == "top_logprobs"
        bad_schema = {
            "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "x"}}
        }
        err = error_of(await client.post("/v1/responses", json={"input": "Hi", "text": bad_schema}))
        assert err["param"] == "text.format" and err["code"] == "invalid_grammar"
        err = error_of(await client.post("/v1/responses", json={"input": "Hi", "model": "other"}), 404)
        assert err["code"] == "model_not_found"


async def test_text_format_json_schema_is_accepted_and_echoed(tokenizer):
    fmt = {
        "type": "json_schema",
        "name": "answer",
        "strict": True,
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    async with running_app(app_for(tokenizer, '{"a": 1}')) as client:
        body = (await client.post("/v1/responses", json={"input": "Hi", "text": {"format": fmt}})).json()
        assert body["text"]["format"] == fmt and json.loads(body["output"][0]["content"][0]["text"]) == {
            "a": 1
        }


async def test_previous_response_id_continues_the_conversation_from_the_cache(tokenizer):
    runner = RecordingRunner(script=[*tokenizer.encode(GREETING, add_special_tokens=False), 2])
    app = app_for(tokenizer, runner=runner)
    async with live_server(app) as url, sdk(url) as client:
        first = await client.responses.create(
            model=MODEL, input="Tell me about the sea. " * 4, instructions="Be brief."
        )
        second = await client.responses.create(
            model=MODEL, input="And the sky?", previous_response_id=first.id, instructions="Be brief."
        )
        assert second.previous_response_id == first.id
        p1, p2 = runner.prompts[f"{first.id}-0"], runner.prompts[f"{second.id}-0"]
        assert p2[: len(p1)] == p1 and len(p2) > len(p1)  # the new prompt extends the previous one
        assert second.usage.input_tokens_details.cached_tokens >= len(p1) // 16 * 16
        third = await client.responses.create(model=MODEL, input="And land?", previous_response_id=second.id)
        text = tokenizer.decode(runner.prompts[f"{third.id}-0"])
        assert "sea" in text and "sky" in text and GREETING in text
        with pytest.raises(openai.NotFoundError) as exc:
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
        assert exc.value.code == "previous_response_not_found" and exc.value.param == "previous_response_id"


async def test_a_full_store_evicts_the_oldest(tokenizer):
    async with running_app(app_for(tokenizer, responses_store_max_entries=2)) as client:
        ids = [(await client.post("/v1/responses", json={"input": f"n{i}"})).json()["id"] for i in range(3)]
        codes = [(await client.get(f"/v1/responses/{i}")).status_code for i in ids]
        assert codes == [404, 200, 200]


def test_store_bounds_by_age_and_count(tmp_path):
    now = [1000.0]
    store = ResponseStore(tmp_path / "sub" / "r.sqlite", max_entries=3, max_age_s=60, clock=lambda: now[0])
    for i in range(5):
        store.put_now({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
        now[0] += 1
    assert store.count() == 3 and store.get_now("r1") is None
    assert store.get_now("r4").messages == [{"role": "user", "content": "4"}]
    now[0] += 59  # r2 was stored at 1002: 61 s ago
    assert store.get_now("r2") is None and store.get_now("r4") is not None
    store.put_now({"id": "r5"}, [])
    assert store.count() == 2  # r2 and r3 expired
    assert store.delete_now("r5") and not store.delete_now("r5")
    store.close()
    reopened = ResponseStore(tmp_path / "sub" / "r.sqlite", 3, 60, clock=lambda: now[0])
    assert reopened.get_now("r4") is not None  # on disk
    reopened.close()


async def test_background_response_polled_and_cancelled(tokenizer):
    runner = scripted(tokenizer, GREETING)
    app = app_for(tokenizer, runner=runner)
    async with live_server(app) as url, sdk(url) as client:
        done = await client.responses.create(model=MODEL, input="Hi", background=True)
        assert done.status in ("queued", "in_progress") and done.background

        async def completed() -> bool:
            return (await client.responses.retrieve(done.id)).status == "completed"

        await wait_until(completed)
        assert (await client.responses.retrieve(done.id)).output_text == GREETING
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(done.id)  # finished
        runner.gate.clear()  # the next response's steps wait
        held = await client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=200)
        await wait_until(lambda: app.state.server.loop.stats().running == 1)
        cancelled = await client.responses.cancel(held.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.cancel(held.id)).status == "cancelled"  # twice: the same answer
        runner.gate.set()
        await drained(app)
        plain = await client.responses.create(model=MODEL, input="Hi")
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(plain.id)
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, input="Hi", background=True, store=False)


async def test_max_output_tokens_makes_it_incomplete(tokenizer):
    async with running_app(app_for(tokenizer, CALL)) as client:
        body = {"input": "Hi", "max_output_tokens": 3}
        r = (await client.post("/v1/responses", json=body)).json()
        assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
        assert r["output"][0]["status"] == "incomplete"
        events = parse_sse((await client.post("/v1/responses", json={**body, "stream": True})).text)
        assert (
            events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
        )
        # A function call cut short comes back as far as it went.
        tools = {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 14}
        r = (await client.post("/v1/responses", json={"input": "Hi", **tools})).json()
        (call,) = r["output"]
        assert (
            call["type"] == "function_call"
            and call["status"] == "incomplete"
            and call["name"] == "get_weather"
        )
        assert '{"city": "Paris"}'.startswith(call["arguments"])
        events = parse_sse(
            (await client.post("/v1/responses", json={"input": "Hi", "stream": True, **tools})).text
        )
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["output"][0]["arguments"] == call["arguments"]


async def test_reasoning_items(thinking_tokenizer):
    reply = "<think>Two and two.</think>It is 4."
    app = app_for(thinking_tokenizer, reply, reasoning_parser="qwen3")
    async with live_server(app) as url, sdk(url) as client:
        r = await client.responses.create(model=MODEL, input="2 + 2?", reasoning={"effort": "low"})
        thought, message = r.output
        assert thought.type == "reasoning" and thought.content[0].text == "Two and two."
        assert r.output_text == "It is 4." and r.reasoning.effort == "low"
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        async with client.responses.stream(model=MODEL, input="2 + 2?") as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert (
            thinking == "Two and two."
            and final.output[0].type == "reasoning"
            and final.output_text == "It is 4."
        )
        # The reasoning goes back with the conversation when it continues.
        follow = await client.responses.create(model=MODEL, input="Sure?", previous_response_id=r.id)
        assert follow.usage.input_tokens > r.usage.input_tokens


async def test_client_gone_mid_stream_frees_its_request(tokenizer):
    body = {"input": "Hi", "stream": True, "max_output_tokens": 300}
    await assert_hanging_up_frees_the_request(tokenizer, "/v1/responses", body, "response.output_text.delta")


async def test_background_tasks_end_with_the_server(tokenizer, tmp_path):
    runner = scripted(tokenizer, GREETING, step_delay_s=0.05)
    app = app_for(tokenizer, runner=runner, responses_store=tmp_path / "r.sqlite")
    async with running_app(app) as client:
        body = {"input": "Hi", "background": True, "max_output_tokens": 200}
        r = (await client.post("/v1/responses", json=body)).json()
        await wait_until(lambda: app.state.server.loop.stats().running == 1)
    # Shutting down cancelled it (200 steps take 10 s) and recorded that.
    assert not app.state.server.background.running(r["id"])
    assert app.state.server.response_store.get_now(r["id"]).response["status"] == "cancelled"


async def test_engine_failure_mid_stream_ends_with_response_failed(tokenizer):
    runner = FakeRunner(script=tokenizer.encode(GREETING * 4, add_special_tokens=False), fail_at_step=3)
    async with running_app(app_for(tokenizer, runner=runner)) as client:
        events = parse_sse((await client.post("/v1/responses", json={"input": "Hi", "stream": True})).text)
        failed = events[-1]
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "generation_failed"
        assert (await client.get(f"/v1/responses/{failed['response']['id']}")).json()["status"] == "failed"
        err = error_of(await client.post("/v1/responses", json={"input": "Hi"}), 500)
        assert err["code"] == "generation_failed"
