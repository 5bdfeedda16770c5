"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

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
    prompt = await encode_chat(tokenizer, body.messages)
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
        meta.id, [prompt], body.n or 1, params, body.stop_strings, bool(body.skip_special_tokens)
    )
    run = start_choices(state, loop, tokenizer, specs, len(prompt))
    if body.stream:
        return stream_response(run, _stream(state, run, meta, body))

    def build(choices: list[CollectedChoice], use: dict[str, int]) -> dict[str, Any]:
        return chat_response(
            meta,
            [
                chat_choice(c.index, c.text, _logprobs_of(state, body, c.logprobs), c.finish_reason)
                for c in choices
            ],
            use,
        )

    return await collect_response(request, run, build)


def _logprobs_of(
    state: ServerState, body: ChatCompletionRequest, entries: list[LogprobEntry]
) -> dict[str, Any] | None:
    if not body.logprobs:
        return None
    assert state.tokenizer is not None
    return chat_logprobs(entries, state.tokenizer)


def _stream(
    state: ServerState, run: ChoiceRun, meta: ResponseMeta, body: ChatCompletionRequest
) -> AsyncIterator[dict[str, Any]]:
    # The first chunk of every choice carries the role, as OpenAI's do.
    roles = [chat_chunk_choice(s.index, {"role": "assistant", "content": ""}) for s in run.specs]

    def choice(d: ChoiceDelta) -> dict[str, Any]:
        delta = {"content": d.text} if d.text else {}
        return chat_chunk_choice(d.index, delta, _logprobs_of(state, body, d.logprobs), d.finish_reason)

    chunk = partial(chat_chunk, meta, with_usage=body.include_usage)
    return stream_chunks(run, roles, choice, chunk, body.include_usage)
