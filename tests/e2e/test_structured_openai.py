"""Structured outputs and tool calls through the official openai client against a real `python -m server`:
the tiny random Llama for the fast checks (a grammar makes even a random model's output valid), the
default model (SmolLM2-135M-Instruct) for the slow ones that read what a real model writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fakes import TINY_SERVER_FLAGS, server_process
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[2]
MODEL = "default"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=130)


def _serve(model: str, tmp_path_factory, extra: list[str]):
    yield from server_process(model, tmp_path_factory.mktemp("server") / "server.log", MODEL, *extra)


@pytest.fixture(scope="module")
def tiny_url(tiny_llama_dir, tmp_path_factory):
    yield from _serve(
        str(tiny_llama_dir),
        tmp_path_factory,
        list(TINY_SERVER_FLAGS),
    )


@pytest.fixture(scope="module")
def default_url(tmp_path_factory):
    yield from _serve("default", tmp_path_factory, [])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _tool_call(client: openai.OpenAI, msgs: list, choice: Any, **sampling: Any) -> Any:
    """A chat completion offered TOOLS with this tool_choice (max_tokens 150)."""
    return client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=150, **sampling
    )


def _check_call(call, tools=TOOLS) -> dict:
    """A call to an offered tool whose arguments satisfy that tool's schema (as the grammar promises)."""
    import llguidance as llg

    offered = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in offered
    args = json.loads(call.function.arguments)
    schema = offered[call.function.name]
    assert set(schema["required"]) <= set(args) <= set(schema["properties"])
    if "unit" in args:
        assert args["unit"] in ("celsius", "fahrenheit")
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(schema)) == ""
    return args


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """Joins delta.tool_calls by index (the name must come first); returns calls, finish, content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name, "a call's first delta names it"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return calls, finish, content


# --- fast: the tiny random model --------------------------------------------------------------------


def test_tiny_named_and_required_tool_choices(tiny_url):
    client = _client(tiny_url)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in (named, "required"):
        r = _tool_call(client, msgs, choice, temperature=1.0, seed=3)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls, c
        for call in c.message.tool_calls:
            _check_call(call)
        if choice is named:
            assert [call.function.name for call in c.message.tool_calls] == ["get_time"]
        stream = _tool_call(client, msgs, choice, stream=True, seed=3)
        calls, finish, content = _streamed_calls(stream)
        assert finish == "tool_calls" and content == "" and calls
        for call in calls.values():
            args = json.loads(call["arguments"])
            assert isinstance(args, dict)


def test_tiny_json_schema_and_guided_fields(tiny_url):
    client = _client(tiny_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A person"}], response_format=fmt,
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        if r.choices[0].finish_reason == "stop":
            Person.model_validate_json(r.choices[0].message.content)
    c = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert c.choices[0].text in ("yes", "no")
    c = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )
    assert len(c.choices[0].text) == 6 and c.choices[0].text[3] == "-"


def test_tiny_bad_input_is_a_400(tiny_url):
    client = _client(tiny_url)
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}),
        dict(
            messages=[*msgs, {"role": "tool", "tool_call_id": "call_missing", "content": "42"}],
        ),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**{"model": MODEL, "messages": msgs, "max_tokens": 4, **kw})
        assert exc.value.status_code == 400 and exc.value.body["message"]
    # Cut short by max_tokens: "length", and the server goes on.
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=3
    )
    assert r.choices[0].finish_reason == "length"
    assert client.models.list().data


# --- slow: the default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_parse_with_a_pydantic_model(default_url):
    client = _client(default_url)
    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person. Reply in JSON with name and age."}],
        response_format=Person,
        max_tokens=100,
        temperature=0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


@pytest.mark.slow
def test_json_schema_stream_at_temperature_one_always_parses(default_url):
    client = _client(default_url)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
    }
    for seed in range(4):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt, max_tokens=150, temperature=1.0, seed=seed, stream=True,
        )  # fmt: skip
        text, finish = "", None
        for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", text
        Person.model_validate_json(text)


@pytest.mark.slow
def test_named_and_required_tool_choices_on_the_default_model(default_url):
    client = _client(default_url)
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # One call: with parallel calls allowed the 135M model appends get_time calls until max_tokens
        # (each valid, the reply cut at "length").
        r = _tool_call(client, msgs, choice, temperature=0, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, (choice, c.message)
        for call in c.message.tool_calls:
            _check_call(call)
        stream = _tool_call(client, msgs, choice, temperature=0, parallel_tool_calls=False, stream=True)
        calls, finish, _ = _streamed_calls(stream)
        assert finish == "tool_calls"
        assert [(x["name"], x["arguments"]) for x in calls.values()] == [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls
        ], "greedy: the stream joins to the non-streamed reply"


@pytest.mark.slow
def test_round_trip_with_a_tool_result(default_url):
    client = _client(default_url)
    msgs: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    second = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    c = second.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls
    # auto: the model may call again or answer; either way the reply is well-formed.
    third = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0
    )
    m = third.choices[0].message
    assert m.content or m.tool_calls
