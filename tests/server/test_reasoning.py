"""Reasoning models: the thinking split from the answer (whole and streamed, every mode), where the
reply starts (from the rendered prompt), the grammar that constrains only the answer after the thinking,
and /v1/chat/completions' reasoning_content with a scripted fake runner and a Qwen3-like template
(tests/fakes.py THINKING_TEMPLATE). The three APIs' own shapes are tested in their own files."""

from __future__ import annotations

import json

import pytest
from fakes import WEATHER_TOOL, make_app, parse_sse, running_app, scripted
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.grammar import GrammarCompiler, GrammarSpec
from server.reasoning import (
    REASONING_FORMATS,
    ReasoningSplitter,
    Thinking,
    ThinkingMode,
    special_tag_problem,
    split_all,
    thinking_grammar,
    thinking_mode,
)

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek_r1"]
USER = [{"role": "user", "content": "What is 2 + 2?"}]

SPLITS = [
    # (mode, reply, reasoning, answer)
    (ThinkingMode.OPTIONAL, "<think>\nLet me add.\n</think>\n\nIt is 4.", "Let me add.\n", "It is 4."),
    (ThinkingMode.OPTIONAL, "It is 4.", "", "It is 4."),
    (ThinkingMode.OPTIONAL, "<thinking> is a word", "", "<thinking> is a word"),
    (ThinkingMode.OPTIONAL, "<think>cut short", "cut short", ""),
    (ThinkingMode.OPEN, "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (ThinkingMode.OPEN, "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (ThinkingMode.OPEN, "no end tag", "no end tag", ""),
    (ThinkingMode.OFF, "<think>a</think>b", "", "<think>a</think>b"),
]


@pytest.mark.parametrize("mode, reply, reasoning, answer", SPLITS)
def test_split_whole_reply(mode, reply, reasoning, answer):
    assert split_all(Thinking(QWEN3, mode), reply) == (reasoning, answer)


@pytest.mark.parametrize("mode, reply, reasoning, answer", SPLITS)
def test_split_at_every_point(mode, reply, reasoning, answer):
    for cut in range(len(reply) + 1):
        splitter = ReasoningSplitter(Thinking(QWEN3, mode))
        got = [splitter.feed(reply[:cut]), splitter.feed(reply[cut:]), splitter.finish()]
        assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == (reasoning, answer), cut


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(SPLITS), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_streamed_split_joins_to_the_whole(case, cuts):
    mode, reply, reasoning, answer = case
    splitter = ReasoningSplitter(Thinking(QWEN3, mode))
    pieces, at = [], 0
    for cut in sorted(cuts):
        pieces.append(reply[at:cut])
        at = max(at, cut)
    pieces.append(reply[at:])
    got = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    assert "".join(r for r, _ in got) == reasoning
    assert "".join(a for _, a in got) == answer


def test_the_prompt_decides_where_the_reply_starts():
    assert thinking_mode(QWEN3, "<|im_start|>assistant\n") is ThinkingMode.OPTIONAL
    assert thinking_mode(QWEN3, "<|im_start|>assistant\n<think>\n") is ThinkingMode.OPEN
    assert thinking_mode(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is ThinkingMode.OFF
    assert thinking_mode(R1, "<|Assistant|>") is ThinkingMode.OPEN  # R1 thinks whether or not it is told
    assert thinking_mode(R1, "<|Assistant|><think>\n\n</think>") is ThinkingMode.OFF


def test_special_tags_are_reported():
    assert special_tag_problem(QWEN3, {"<|im_end|>"}) is None
    assert "special" in special_tag_problem(QWEN3, {"<think>", "<|im_end|>"})


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.hf, 49152, [2])


def _accepts(compiler, spec: GrammarSpec, text: str, tokenizer) -> bool:
    matcher = compiler.compile(spec).new_matcher().matcher
    return bool(matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))) and bool(
        matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "mode, text, ok",
    [
        (ThinkingMode.OPTIONAL, '<think>any {text} </ here</think>\n\n{"n": 4}', True),
        (ThinkingMode.OPTIONAL, '{"n": 4}', True),
        (ThinkingMode.OPTIONAL, "<think>a</think>four", False),
        (ThinkingMode.OPTIONAL, 'thinking without a tag</think>{"n": 4}', False),
        (ThinkingMode.OPEN, 'free text</think> {"n": 4}', True),
        (ThinkingMode.OPEN, '<think>free text</think>{"n": 4}', True),
        (ThinkingMode.OPEN, '{"n": 4}', False),  # the prompt opened the thinking: it must close first
        (ThinkingMode.OFF, '{"n": 4}', True),
        (ThinkingMode.OFF, '<think>a</think>{"n": 4}', False),
    ],
)
def test_grammar_constrains_only_the_answer(compiler, tokenizer, mode, text, ok):
    spec = thinking_grammar(GrammarSpec.json_schema(SCHEMA), Thinking(QWEN3, mode))
    assert _accepts(compiler, spec, text, tokenizer) is ok


def test_grammar_wraps_lark_and_regex_answers(compiler, tokenizer):
    hermes = GrammarSpec("lark", 'start: "<tool_call>\\n" %json {"type": "object"} "\\n</tool_call>"\n')
    opened = Thinking(QWEN3, ThinkingMode.OPEN)
    assert _accepts(
        compiler, thinking_grammar(hermes, opened), 'x</think><tool_call>\n{"a": 1}\n</tool_call>', tokenizer
    )
    regex = thinking_grammar(GrammarSpec("regex", "[a-z]+"), Thinking(QWEN3, ThinkingMode.OPTIONAL))
    assert _accepts(compiler, regex, "<think>1 2 3</think>abc", tokenizer)
    assert not _accepts(compiler, regex, "<think>1 2 3</think>ABC", tokenizer)


# --- chat completions --------------------------------------------------------------------------------

REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."


async def test_chat_returns_reasoning_under_both_names(thinking_tokenizer):
    runner = scripted(thinking_tokenizer, REPLY)
    async with running_app(make_app(thinking_tokenizer, runner, reasoning_parser="qwen3")) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64})
        message = r.json()["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == "Two and two.\n"
        assert message["content"] == "It is 4." and r.json()["choices"][0]["finish_reason"] == "stop"
        r = await client.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 64, "stream": True}
        )
        deltas = [e["choices"][0]["delta"] for e in parse_sse(r.text) if e != "[DONE]"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two.\n"
        assert "".join(d.get("reasoning", "") for d in deltas) == "Two and two.\n"
        assert "".join(d.get("content", "") for d in deltas) == "It is 4."
        # Every thinking delta comes before the first answer delta.
        kinds = [
            "r" if "reasoning_content" in d else "c"
            for d in deltas
            if d.get("reasoning_content") or d.get("content")
        ]
        assert kinds == sorted(kinds, reverse=True)


async def test_without_the_parser_the_tags_stay_in_the_text(thinking_tokenizer):
    async with running_app(make_app(thinking_tokenizer, scripted(thinking_tokenizer, REPLY))) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64})
        message = r.json()["choices"][0]["message"]
        assert message["content"] == REPLY and "reasoning_content" not in message


async def test_template_kwargs_and_reasoning_effort_reach_the_template(thinking_tokenizer):
    """enable_thinking=false makes the template close the thinking in the prompt, so the reply is all
    answer; reasoning_effort "high" makes it open it there, so the reply starts inside the thinking."""
    runner = scripted(thinking_tokenizer, "<think>a</think>b")
    async with running_app(make_app(thinking_tokenizer, runner, reasoning_parser="qwen3")) as client:
        body = {"messages": USER, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": False}}
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert message["content"] == "<think>a</think>b" and "reasoning_content" not in message
    runner = scripted(thinking_tokenizer, "plan</think>answer")
    async with running_app(make_app(thinking_tokenizer, runner, reasoning_parser="qwen3")) as client:
        body = {"messages": USER, "max_tokens": 64, "reasoning_effort": "high"}
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("plan", "answer")
        bad = {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}
        r = await client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


async def test_earlier_thinking_goes_back_to_the_template(thinking_tokenizer):
    """An assistant turn's reasoning_content is rendered by templates that read it: the prompt grows."""
    runner = scripted(thinking_tokenizer, "ok")
    async with running_app(make_app(thinking_tokenizer, runner, reasoning_parser="qwen3")) as client:
        turn = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
        plain = (await client.post("/v1/chat/completions", json={"messages": turn})).json()
        turn[1] = {**turn[1], "reasoning": "two and two make four, twice over"}
        thought = (await client.post("/v1/chat/completions", json={"messages": turn})).json()
        assert thought["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


WEATHER = WEATHER_TOOL


async def test_tool_calls_are_read_from_the_answer_only(thinking_tokenizer):
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    reply = '<think>I could write {"tool_calls": []} here.</think>' + call
    runner = scripted(thinking_tokenizer, reply)
    async with running_app(make_app(thinking_tokenizer, runner, reasoning_parser="qwen3")) as client:
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 80}
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == 'I could write {"tool_calls": []} here.'
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
        (only,) = choice["message"]["tool_calls"]
        assert only["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in parse_sse(r.text) if e != "[DONE]"]
        args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
        assert json.loads(args) == {"city": "Paris"}
