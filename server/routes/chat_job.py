"""A chat-shaped request from its validated body to running choices: the one path that
/v1/chat/completions, /v1/responses and /v1/messages share. The latter two translate their bodies into a
`ChatCompletionRequest` first (server/responses_api/convert.py, server/anthropic/convert.py), so tools,
tool_choice, structured outputs, reasoning, the server's caps and sampling are checked and applied in one
place, and each API only writes its own shapes around the same `ReplyParser` events.

Steps: the server's caps; the tool plan; the prompt (chat template with the tools and the template's
own variables); where the reply's thinking starts (from the rendered prompt); the grammar (tool calls or
the response format, behind the thinking when the prompt opens it); max_tokens; the choices submitted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.grammar import CompiledGrammar, GrammarSpec
from server.errors import context_length_exceeded, invalid
from server.generation import LoopClient, merge_choices
from server.protocol import ChatCompletionRequest, ChatMessage
from server.reasoning import REASONING_FORMATS, Thinking, thinking_grammar, thinking_mode
from server.reply import Reply, ReplyEvent, ReplyParser
from server.routes.common import check_context, check_limits, choice_specs, offload, sampling_params
from server.routes.fanout import ChoiceRun, UsageTally, start_choices
from server.state import ServerState
from server.structured import compile_constraint, output_constraint
from server.tokenizer import ServerTokenizer
from server.tools import (
    ToolPlan,
    call_grammar,
    check_tool_history,
    parameters_schema,
    plan_tools,
    render_messages,
)


@dataclass
class ChatJob:
    """A chat request's choices, running, and what it takes to read their replies."""

    body: ChatCompletionRequest
    plan: ToolPlan | None
    thinking: Thinking | None
    prompt: list[int]
    run: ChoiceRun

    def parser(self) -> ReplyParser:
        return ReplyParser(self.thinking, self.plan)

    def reply(self, text: str, finish_reason: str | None) -> Reply:
        return self.parser().parse_all(text, finish_reason)

    async def updates(self, tally: UsageTally) -> AsyncIterator[ReplyUpdate]:
        """The reply of a one-choice request as events, under the deadline (whose expiry raises its
        APIError here); `tally` counts the usage. Closing it aborts the choice."""
        parser = self.parser()
        try:
            async for d in self.run.deadline.iterate(merge_choices(self.run.gens)):
                tally.observe(d)
                events = parser.feed(d.text)
                if d.finish_reason is not None:
                    events += parser.finish(d.finish_reason)
                yield ReplyUpdate(events, d.finish_reason, d.stop_string)
        finally:
            self.run.abort()


@dataclass
class ReplyUpdate:
    events: list[ReplyEvent]
    finish_reason: str | None  # on the last update
    stop_string: str | None  # on the last update: the stop string that ended the reply, if one did


def reasoning_tokens(tokenizer: ServerTokenizer, reasoning: str | None) -> int:
    """The thinking's share of the output tokens, counted by encoding its text again (the split is made
    on text, so the exact tokens are not tracked; a re-encoding can differ from the sampled tokens by a
    token or two where they split differently)."""
    return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


async def render_prompt(
    tokenizer: ServerTokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    plan: ToolPlan | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The conversation through the chat template: its text and its token ids."""
    if not tokenizer.has_chat_template:
        raise invalid(
            "This model has no chat template, so chat requests cannot be served; use /v1/completions.",
            param="messages",
            code="chat_template_missing",
        )
    check_tool_history(messages)
    msgs = render_messages(messages, plan)
    tools = plan.definitions() if plan is not None and plan.native else None
    size = sum(len(str(m.get("content") or "")) for m in msgs)
    try:
        text = await offload(tokenizer.render_chat, msgs, add_generation_prompt, tools, kwargs, size=size)
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None
    return text, await offload(tokenizer.encode_rendered, text, size=size)


def request_thinking(state: ServerState, prompt_text: str) -> Thinking | None:
    name = state.config.reasoning_parser
    if name is None:
        return None
    fmt = REASONING_FORMATS[name]
    return Thinking(fmt, thinking_mode(fmt, prompt_text))


async def chat_grammar(
    state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None, thinking: Thinking | None
) -> CompiledGrammar | None:
    """The reply's grammar: the tool calls' (required / named) or the response format's, behind the
    thinking the prompt opens (only the answer is constrained). Every tool's parameters are compiled
    too, so a schema that is not one is a 400 whatever the tool_choice."""
    compiler = state.grammars
    assert compiler is not None  # set with the tokenizer
    constraint = output_constraint(body)
    if plan is not None:
        for i, tool in enumerate(plan.tools):
            param = f"tools.{i}.function.parameters"
            await compile_constraint(compiler, GrammarSpec.json_schema(parameters_schema(tool)), param)
    if plan is not None and plan.constrained:
        if constraint is not None:
            raise invalid(
                f"{constraint[1]} cannot be combined with tool_choice {plan.choice!r}: the reply is a tool call.",
                param=constraint[1],
            )
        constraint = (call_grammar(plan), "tools")
    if constraint is None:
        return None
    spec, param = constraint
    if thinking is not None:
        await compile_constraint(compiler, spec, param)  # a bad schema is reported as it was written
        spec = thinking_grammar(spec, thinking)
    return await compile_constraint(compiler, spec, param)


def max_tokens_for(state: ServerState, max_model_len: int, prompt_len: int, requested: int | None) -> int:
    if requested is None:  # as much as fits, as vLLM does
        if prompt_len >= max_model_len:
            raise context_length_exceeded(max_model_len, prompt_len, 1)
        limit = max_model_len - prompt_len
        return limit if state.config.max_tokens is None else min(limit, state.config.max_tokens)
    check_context(max_model_len, prompt_len, requested)
    return requested


async def start_chat(
    state: ServerState,
    loop: LoopClient,
    tokenizer: ServerTokenizer,
    body: ChatCompletionRequest,
    request_id: str,
) -> ChatJob:
    """Check, render and submit a chat request: its choices run from here (under the deadline)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true.", param="top_logprobs")
    check_limits(
        state,
        n=body.n or 1,
        num_prompts=1,
        logprobs=body.top_logprobs,
        logprobs_param="top_logprobs",
        num_stops=len(body.stop_strings),
        max_tokens=body.requested_max_tokens,
    )
    plan = plan_tools(body, tokenizer.chat_template)
    text, prompt = await render_prompt(tokenizer, body.messages, True, plan, template_kwargs(body))
    thinking = request_thinking(state, text)
    grammar = await chat_grammar(state, body, plan, thinking)
    max_tokens = max_tokens_for(state, loop.max_model_len, len(prompt), body.requested_max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, state.vocab_size)
    specs = choice_specs(
        request_id, [prompt], body.n or 1, params, body.stop_strings, bool(body.skip_special_tokens), grammar
    )
    run = start_choices(state, loop, tokenizer, specs, len(prompt))
    return ChatJob(body, plan, thinking, prompt, run)
