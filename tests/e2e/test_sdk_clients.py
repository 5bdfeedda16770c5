"""Clients nobody here wrote, against a real `python -m server` on the tiny random Llama (issue #27): the
openai client's Responses API (responses.create, responses.stream, continuation, retrieval), the OpenAI
Agents SDK's default Responses model running a function tool to completion, the anthropic client
(messages.create, streamed, a tool round trip), and a chat tool call cut by max_tokens (LangChain's
bind_tools(tool_choice=<name>) with max_tokens=32 case). The model's text is gibberish, so grammars
(tool_choice, output types) force the structure, and the tests check structure."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest
from fakes import TINY_SERVER_FLAGS, server_process
from pydantic import BaseModel

MODEL = "default"
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}  # an enum: a random model finishes it at once
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server_url(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    flags = [*TINY_SERVER_FLAGS, "--responses-store", str(tmp / "responses.sqlite")]
    yield from server_process(str(tiny_llama_dir), tmp / "server.log", MODEL, *flags)


@pytest.fixture
def oai(server_url):
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_responses_create_stream_and_continue(oai):
    plain = oai.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output[0].type == "message" and plain.usage.output_tokens == 6
    forced = oai.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    )
    assert forced.status == "completed"
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in CITY["enum"]
    with oai.responses.stream(
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a random model would add calls until max_output_tokens
        max_output_tokens=200,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == final.output[0].arguments and json.loads(args)["city"] in CITY["enum"]
    # A function call's output sent back continues the stored conversation from the prefix cache (the
    # tools are sent again: a continuation does not carry them over, as OpenAI's does not).
    follow = oai.responses.create(
        model=MODEL,
        previous_response_id=forced.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        text={"format": {"type": "json_schema", "name": "verdict", "strict": True, "schema": VERDICT}},
        max_output_tokens=200,
    )
    assert follow.status == "completed" and json.loads(follow.output_text)["sky"] in ("clear", "cloudy")
    assert follow.usage.input_tokens_details.cached_tokens >= forced.usage.input_tokens // 16 * 16 > 0
    assert oai.responses.retrieve(follow.id).output_text == follow.output_text
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


VERDICT = {
    "type": "object",
    "properties": {"sky": {"type": "string", "enum": ["clear", "cloudy"]}},
    "required": ["sky"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    sky: Literal["clear", "cloudy"]


@pytest.mark.parametrize("streamed", [False, True])
async def test_agents_sdk_runs_a_function_tool_to_completion(server_url, streamed):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        output_type=Verdict,  # the last turn's answer, through text.format's grammar
        # The first turn must call the tool; the SDK then resets tool_choice so the run can finish.
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=160, temperature=0),
    )
    if streamed:
        result = Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = await Runner.run(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Oslo")
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item"
    assert isinstance(result.final_output, Verdict)
    await client.close()


ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": WEATHER["parameters"],
}


def test_anthropic_messages_create_stream_and_tool_round_trip(server_url):
    client = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=user, extra_body={"temperature": 0})
    assert (
        plain.stop_reason == "max_tokens"
        and plain.content[0].type == "text"
        and plain.usage.output_tokens == 6
    )
    with client.messages.stream(
        model=MODEL, max_tokens=6, messages=user, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text and final.stop_reason == "max_tokens"
    force = {"type": "tool", "name": "get_weather"}
    used = client.messages.create(
        model=MODEL, max_tokens=200, messages=user, tools=[ANTHROPIC_WEATHER], tool_choice=force
    )
    (use,) = used.content
    assert used.stop_reason == "tool_use" and use.type == "tool_use" and use.input["city"] in CITY["enum"]
    history = [
        *user,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Snow, -3 C"}],
        },
    ]
    with client.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=history,
        output_config={"format": {"type": "json_schema", "schema": VERDICT}},
    ) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason == "end_turn" and json.loads(answer.content[0].text)["sky"] in (
        "clear",
        "cloudy",
    )
    assert answer.usage.cache_read_input_tokens > 0  # the turn before it came from the prefix cache
    count = client.messages.count_tokens(model=MODEL, messages=history)
    assert count.input_tokens > used.usage.input_tokens
    client.close()


def test_chat_tool_call_cut_by_max_tokens_is_returned(oai):
    """LangChain's bind_tools(tools, tool_choice="get_weather") with max_tokens=32, in the openai client:
    the call cut short comes back as far as it went, with finish_reason "length"."""
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 12,
    }
    chat = oai.chat.completions.create(**body)
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    streamed = oai.chat.completions.create(**body, stream=True)
    pieces = [t for chunk in streamed for c in chunk.choices for t in (c.delta.tool_calls or [])]
    assert [p.function.name for p in pieces if p.id] == ["get_weather"]
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
