"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.grammar import CompiledGrammar, GrammarSpec
from server.errors import context_length_exceeded, invalid
from server.generation import ChoiceDelta, LogprobEntry
from server.protocol import ChatCompletionRequest, ChatMessage
from server.responses import (
    ResponseMeta,
    chat_choice,
    chat_chunk,
    chat_chunk_choice,
    chat_logprobs,
    chat_response,
    tool_call,
    tool_call_delta,
)
from server.routes.common import (
    check_context,
    check_limits,
    choice_specs,
    offload,
    ready_for,
    sampling_params,
)
from server.routes.fanout import (
    ChoiceRun,
    CollectedChoice,
    collect_response,
    start_choices,
    stream_chunks,
    stream_response,
)
from server.state import ServerState
from server.structured import compile_constraint, output_constraint
from server.tokenizer import RESERVED_TEMPLATE_KWARGS, ServerTokenizer
from server.tool_parsers import ToolCallParser, ToolCallStart
from server.tools import (
    ToolPlan,
    call_grammar,
    check_tool_history,
    parameters_schema,
    plan_tools,
    render_messages,
)

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


async def encode_chat(
    tokenizer: ServerTokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    plan: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    if not tokenizer.has_chat_template:
        raise invalid(
            "This model has no chat template, so /v1/chat/completions cannot be used; use /v1/completions.",
            param="messages",
            code="chat_template_missing",
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
    if reserved:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them).",
            param="chat_template_kwargs",
        )
    check_tool_history(messages)
    msgs = render_messages(messages, plan)
    tools = plan.definitions() if plan is not None and plan.native else None
    size = sum(len(str(m.get("content") or "")) for m in msgs)
    try:
        return await offload(
            tokenizer.encode_chat, msgs, add_generation_prompt, tools, template_kwargs, size=size
        )
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true.", param="top_logprobs")


async def _grammar(
    state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None
) -> CompiledGrammar | None:
    """The reply's grammar: the tool calls' (required / named) or the response format's. Every tool's
    parameters are compiled too, so a schema that is not one is a 400 whatever the tool_choice."""
    compiler = state.grammars
    assert compiler is not None  # set with the tokenizer
    constraint = output_constraint(body)
    if plan is None:
        return None if constraint is None else await compile_constraint(compiler, *constraint)
    for i, tool in enumerate(plan.tools):
        param = f"tools.{i}.function.parameters"
        await compile_constraint(compiler, GrammarSpec.json_schema(parameters_schema(tool)), param)
    if not plan.constrained:
        return None if constraint is None else await compile_constraint(compiler, *constraint)
    if constraint is not None:
        raise invalid(
            f"{constraint[1]} cannot be combined with tool_choice {plan.choice!r}: the reply is a tool call.",
            param=constraint[1],
        )
    return await compile_constraint(compiler, call_grammar(plan), "tools")


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    _check_unsupported(body)
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
    prompt = await encode_chat(tokenizer, body.messages, plan=plan, template_kwargs=body.chat_template_kwargs)
    grammar = await _grammar(state, body, plan)
    limit = loop.max_model_len
    requested = body.requested_max_tokens
    if requested is None:  # as much as fits, as vLLM does
        if len(prompt) >= limit:
            raise context_length_exceeded(limit, len(prompt), 1)
        max_tokens = limit - len(prompt)
        if state.config.max_tokens is not None:
            max_tokens = min(max_tokens, state.config.max_tokens)
    else:
        check_context(limit, len(prompt), requested)
        max_tokens = requested
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, state.vocab_size)
    meta = ResponseMeta.new("chatcmpl", state.config.model_name)
    specs = choice_specs(
        meta.id, [prompt], body.n or 1, params, body.stop_strings, bool(body.skip_special_tokens), grammar
    )
    run = start_choices(state, loop, tokenizer, specs, len(prompt))
    if body.stream:
        return stream_response(run, _stream(state, run, meta, body, plan))

    def build(choices: list[CollectedChoice], use: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            lp = _logprobs_of(state, body, c.logprobs)
            if plan is None:
                out.append(chat_choice(c.index, c.text, lp, c.finish_reason))
                continue
            reply = ToolCallParser(plan.fmt).parse_all(c.text)
            calls = [tool_call(*call) for call in reply.calls]
            out.append(chat_choice(c.index, reply.content, lp, _finish(c.finish_reason, bool(calls)), calls))
        return chat_response(meta, out, use)

    return await collect_response(request, run, build)


def _logprobs_of(
    state: ServerState, body: ChatCompletionRequest, entries: list[LogprobEntry]
) -> dict[str, Any] | None:
    if not body.logprobs:
        return None
    assert state.tokenizer is not None
    return chat_logprobs(entries, state.tokenizer)


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason for a reply that made tool calls (a length cut stays "length")."""
    return "tool_calls" if called and reason == "stop" else reason


def _stream(
    state: ServerState, run: ChoiceRun, meta: ResponseMeta, body: ChatCompletionRequest, plan: ToolPlan | None
) -> AsyncIterator[dict[str, Any]]:
    # The first chunk of every choice carries the role, as OpenAI's do.
    roles = [chat_chunk_choice(s.index, {"role": "assistant", "content": ""}) for s in run.specs]
    parsers = {s.index: ToolCallParser(plan.fmt) for s in run.specs} if plan is not None else {}

    def choice(d: ChoiceDelta) -> dict[str, Any]:
        lp = _logprobs_of(state, body, d.logprobs)
        parser = parsers.get(d.index)
        if parser is None:
            delta = {"content": d.text} if d.text else {}
            return chat_chunk_choice(d.index, delta, lp, d.finish_reason)
        content, events = parser.feed(d.text)
        if d.finish_reason is not None:
            tail, more = parser.finish()
            content, events = content + tail, events + more
        delta = {"content": content} if content else {}
        if events:
            delta["tool_calls"] = [
                tool_call_delta(e.index, call_id=e.id, name=e.name)
                if isinstance(e, ToolCallStart)
                else tool_call_delta(e.index, arguments=e.text)
                for e in events
            ]
        return chat_chunk_choice(d.index, delta, lp, _finish(d.finish_reason, parser.num_calls > 0))

    chunk = partial(chat_chunk, meta, with_usage=body.include_usage)
    return stream_chunks(run, roles, choice, chunk, body.include_usage)
