"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from scheduler.loop import EngineDeadError
from server.errors import context_length_exceeded, invalid
from server.generation import (
    ChoiceDelta,
    ChoiceSpec,
    EngineClient,
    GenerationError,
    LogprobEntry,
    generate_choice,
    merge_choices,
    open_choices,
)
from server.protocol import ChatCompletionRequest, ChatMessage
from server.responses import (
    ResponseMeta,
    chat_choice,
    chat_chunk,
    chat_chunk_choice,
    chat_logprobs,
    chat_response,
    usage,
)
from server.routes.common import (
    ClientDisconnected,
    Deadline,
    abort_all,
    admit,
    cancel_on_disconnect,
    check_context,
    check_draining,
    check_limits,
    check_model,
    choice_specs,
    disconnected_response,
    engine_error,
    get_state,
    offload,
    sampling_params,
    sse,
)
from server.state import ServerState
from server.tokenizer import ServerTokenizer

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    # "developer" is OpenAI's new name for "system"; chat templates only know the latter.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


async def encode_chat(
    tokenizer: ServerTokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    if not tokenizer.has_chat_template:
        raise invalid(
            "This model has no chat template, so /v1/chat/completions cannot be used; use /v1/completions.",
            param="messages",
            code="chat_template_missing",
        )
    msgs = template_messages(messages)
    size = sum(len(m["content"]) for m in msgs)
    try:
        return await offload(tokenizer.encode_chat, msgs, add_generation_prompt, size=size)
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise invalid("tools (function calling) are not supported by this server.", param="tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise invalid("tool_choice is not supported by this server.", param="tool_choice")
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise invalid(
            "response_format other than {'type': 'text'} is not supported by this server.",
            param="response_format",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true.", param="top_logprobs")


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    engine, tokenizer = state.require_ready()
    check_draining(state)
    check_model(state, body.model)
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
    prompt = await encode_chat(tokenizer, body.messages)
    limit = engine.max_model_len
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
        meta.id, [prompt], body.n or 1, params, body.stop_strings, bool(body.skip_special_tokens)
    )
    admit(state, engine, len(specs))
    try:
        streams = open_choices(engine, specs)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    deadline = Deadline(state, state.config.request_timeout_s)
    gens = [
        generate_choice(engine, tokenizer, s, st, state.metrics.tracker())
        for s, st in zip(specs, streams, strict=True)
    ]
    if body.stream:
        return sse(
            deadline.iterate(_stream(state, engine, specs, gens, meta, body, len(prompt))),
            lambda: abort_all(engine, specs),
        )
    try:
        result = await cancel_on_disconnect(
            request, deadline.run(_collect(state, engine, specs, gens, meta, body, len(prompt)))
        )
    except ClientDisconnected:
        abort_all(engine, specs)  # in case the work was cancelled before it started
        return disconnected_response()
    except (GenerationError, EngineDeadError) as exc:
        raise engine_error(exc) from None
    return JSONResponse(result)


def _logprobs_of(
    state: ServerState, body: ChatCompletionRequest, entries: list[LogprobEntry]
) -> dict[str, Any] | None:
    if not body.logprobs:
        return None
    assert state.tokenizer is not None
    return chat_logprobs(entries, state.tokenizer)


async def _collect(
    state: ServerState,
    engine: EngineClient,
    specs: list[ChoiceSpec],
    gens: list[AsyncIterator[ChoiceDelta]],
    meta: ResponseMeta,
    body: ChatCompletionRequest,
    prompt_tokens: int,
) -> dict[str, Any]:
    texts: dict[int, list[str]] = {s.index: [] for s in specs}
    entries: dict[int, list[LogprobEntry]] = {s.index: [] for s in specs}
    finish: dict[int, str | None] = {}
    completion_tokens: dict[int, int] = {}
    try:
        async for d in merge_choices(gens):
            texts[d.index].append(d.text)
            entries[d.index].extend(d.logprobs)
            completion_tokens[d.index] = d.completion_tokens
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
    finally:
        abort_all(engine, specs)
    choices = [
        chat_choice(
            s.index, "".join(texts[s.index]), _logprobs_of(state, body, entries[s.index]), finish.get(s.index)
        )
        for s in specs
    ]
    return chat_response(meta, choices, usage(prompt_tokens, sum(completion_tokens.values())))


async def _stream(
    state: ServerState,
    engine: EngineClient,
    specs: list[ChoiceSpec],
    gens: list[AsyncIterator[ChoiceDelta]],
    meta: ResponseMeta,
    body: ChatCompletionRequest,
    prompt_tokens: int,
) -> AsyncIterator[dict[str, Any]]:
    with_usage = body.include_usage
    completion_tokens: dict[int, int] = {}
    try:
        # The first chunk of every choice carries the role, as OpenAI's do.
        for s in specs:
            role = chat_chunk_choice(s.index, {"role": "assistant", "content": ""})
            yield chat_chunk(meta, [role], with_usage=with_usage)
        async for d in merge_choices(gens):
            completion_tokens[d.index] = d.completion_tokens
            delta = {"content": d.text} if d.text else {}
            choice = chat_chunk_choice(d.index, delta, _logprobs_of(state, body, d.logprobs), d.finish_reason)
            yield chat_chunk(meta, [choice], with_usage=with_usage)
    finally:
        abort_all(engine, specs)
    if with_usage:
        yield chat_chunk(meta, [], usage(prompt_tokens, sum(completion_tokens.values())), with_usage=True)
