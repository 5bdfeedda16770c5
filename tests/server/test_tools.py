"""Tool calling over HTTP with a scripted fake runner (the reply's text is fixed, so parsing, response
shapes, streaming and errors are what is tested; the grammar masks themselves are tested in
tests/engine/test_grammar_mask.py and tests/e2e/test_structured_openai.py), plus the parsers and the
rendering on their own."""

from __future__ import annotations

import json

import pytest
from fakes import FakeRunner, error_of, make_app, parse_sse, running_app
from hypothesis import given, settings
from hypothesis import strategies as st

from server.protocol import ChatCompletionRequest, ChatMessage
from server.tool_parsers import TOOL_FORMATS, ToolArgsDelta, ToolCallParser, ToolCallStart
from server.tools import FALLBACK_INSTRUCTIONS, call_grammar, plan_tools, render_messages, template_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'

REPLIES = {
    "generic": [
        (CALL_TEXT, None, [("get_weather", '{"city": "Paris"}')]),
        ('{"tool_call": {"name": "f", "arguments": {"q": "a\\"}"}}}', None, [("f", '{"q": "a\\"}"}')]),
        ("Hello there", "Hello there", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]}', None,
         [("a", "{}"), ("b", '{"x": [1]}')]),
    ],
    "hermes": [
        ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure.",
         [("get_weather", '{"city": "Paris"}')]),
        ("a < b <tool", "a < b <tool", []),
    ],
    "llama3": [('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')])],
    "mistral": [
        ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', None, [("a", '{"x": 1}')]),
        ('[{"name": "a", "arguments": {"x": 1}}]', None, [("a", '{"x": 1}')]),
    ],
}  # fmt: skip
CASES = [(fmt, *case) for fmt, cases in REPLIES.items() for case in cases]


def stream_parse(fmt: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ToolCallParser(TOOL_FORMATS[fmt])
    content, calls = "", {}
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for text, events in outs:
        content += text
        for e in events:
            if isinstance(e, ToolCallStart):
                assert e.index not in calls, "a call is announced once"
                calls[e.index] = [e.name, ""]
            else:
                assert isinstance(e, ToolArgsDelta) and e.index in calls, "arguments come after the name"
                calls[e.index][1] += e.text
    return content or None, [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parsers_read_each_format(fmt, text, content, calls):
    reply = ToolCallParser(TOOL_FORMATS[fmt]).parse_all(text)
    assert reply.content == content
    assert [(n, a) for _, n, a in reply.calls] == calls
    assert all(i.startswith("call_") for i, _, _ in reply.calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_parse_joins_to_the_whole_parse(case, cuts):
    fmt, text, content, calls = case
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream_parse(fmt, pieces) == (content, calls)


def test_template_format_detection(tokenizer):
    assert template_format(tokenizer.chat_template) == (TOOL_FORMATS["generic"], False)
    assert template_format("{% if tools %}<tool_call>{% endif %}")[0].name == "hermes"
    assert template_format("{{ tools }}[TOOL_CALLS]")[0].name == "mistral"
    assert template_format("{{ tools }}<|start_header_id|>")[0].name == "llama3"


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def test_fallback_rendering_puts_tools_in_the_system_prompt_and_history_as_text(tokenizer):
    msgs = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]  # fmt: skip
    body = _request(messages=msgs, tools=[WEATHER])
    plan = plan_tools(body, tokenizer.chat_template)
    assert plan is not None and not plan.native and plan.choice == "auto"
    rendered = render_messages(body.messages, plan)
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith(FALLBACK_INSTRUCTIONS)
    assert '"get_weather"' in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    }
    assert rendered[3]["role"] == "user"
    assert json.loads(rendered[3]["content"])["tool_response"] == {
        "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"
    }  # fmt: skip
    prompt = tokenizer.render_chat(rendered)
    assert "get_weather" in prompt and "21 C" in prompt


def test_native_rendering_hands_tools_to_the_template(tokenizer):
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.arguments | tojson }}"
        "</tool_call>{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    body = _request(
        messages=[*USER, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]}, {"role": "tool", "tool_call_id": "c1", "content": "cold"}],
        tools=[WEATHER],
    )  # fmt: skip
    plan = plan_tools(body, template)
    assert plan is not None and plan.native and plan.fmt.name == "hermes"
    rendered = render_messages(body.messages, plan)
    original = tokenizer.hf.chat_template
    try:
        tokenizer.hf.chat_template = template
        prompt = tokenizer.render_chat(rendered, tools=plan.definitions())
    finally:
        tokenizer.hf.chat_template = original
    assert prompt.startswith("TOOL get_weather\n")
    assert '<tool_call>{"city": "Oslo"}</tool_call>' in prompt and "tool: cold" in prompt


def test_call_grammars_per_format():
    for native_template, marker in [(None, '"tool_calls"'), ("tools <tool_call>", "<tool_call>")]:
        plan = plan_tools(_request(tools=[WEATHER], tool_choice="required"), native_template)
        assert plan is not None and plan.constrained
        assert marker in call_grammar(plan).text
    named = plan_tools(
        _request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None
    )
    assert named is not None and not named.parallel and '"maxItems":1' in call_grammar(named).text


def ending(tokenizer, text: str):
    """An app whose fake model writes `text` and then EOS."""
    script = [*tokenizer.encode(text, add_special_tokens=False), 2]
    return running_app(make_app(tokenizer, FakeRunner(script=script)))


async def test_auto_tool_call_reply_shape(tokenizer):
    async with ending(tokenizer, CALL_TEXT) as client:
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 200}
        r = (await client.post("/v1/chat/completions", json=body)).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] is None and msg["role"] == "assistant"
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

        events = parse_sse((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        deltas = [ch for e in events if e != "[DONE]" for ch in e["choices"]]
        pieces = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
        assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
        assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
        assert {p["index"] for p in pieces} == {0}
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert "".join(d["delta"].get("content") or "" for d in deltas) == ""


async def test_plain_reply_with_tools_offered_is_content(tokenizer):
    async with ending(tokenizer, "It is sunny.") as client:
        r = (
            await client.post(
                "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "max_tokens": 4}
            )
        ).json()
        assert r["choices"][0]["message"]["content"] == "It is sunny."
        assert "tool_calls" not in r["choices"][0]["message"]


BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages.1.tool_call_id"),
    ({"messages": [*USER, {"role": "user", "tool_calls": []}]}, "messages.1"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
]  # fmt: skip


async def test_bad_tool_and_constraint_requests_are_400s(tokenizer):
    async with running_app(make_app(tokenizer, FakeRunner())) as client:
        for extra, param in BAD:
            body = {"messages": USER, "max_tokens": 2, **extra}
            err = error_of(await client.post("/v1/chat/completions", json=body))
            assert err["param"] == param, (extra, err)
        err = error_of(await client.post("/v1/completions", json={"prompt": "x", "guided_json": {"type": 1}}))
        assert err["param"] == "guided_json" and err["code"] == "invalid_grammar"
        # The server goes on.
        ok = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert ok.status_code == 200


async def test_tool_choice_none_renders_no_tools(tokenizer):
    runner = FakeRunner()
    async with running_app(make_app(tokenizer, runner)) as client:
        body = {"messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2}
        r = (await client.post("/v1/chat/completions", json=body)).json()
        assert r["choices"][0]["finish_reason"] == "length" and "tool_calls" not in r["choices"][0]["message"]
        with_tools = await client.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
        assert with_tools.json()["usage"]["prompt_tokens"] > r["usage"]["prompt_tokens"]


def test_messages_accept_tool_calls_with_null_content():
    m = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]}
    )  # fmt: skip
    assert m.text() == "" and m.tool_calls is not None
