"""POST /v1/chat/completions: the shared chat path (server/routes/chat_job.py) written out as OpenAI's
chat completion objects and chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.generation import ChoiceDelta, LogprobEntry
from server.protocol import ChatCompletionRequest
from server.reply import ReplyEvent, ReplyParser, TextPiece
from server.responses import (
    ResponseMeta,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    chat_response,
    stream_chunk,
    tool_call,
    tool_call_delta,
)
from server.routes.chat_job import ChatJob, start_chat
from server.routes.common import ready_for
from server.routes.fanout import CollectedChoice, collect_response, stream_chunks, stream_response
from server.state import ServerState
from server.tool_parsers import ToolCallStart

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    meta = ResponseMeta.new("chatcmpl", state.config.model_name)
    job = await start_chat(state, loop, tokenizer, body, meta.id)
    if body.stream:
        return stream_response(job.run, _stream(state, job, meta))

    def build(choices: list[CollectedChoice], use: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            lp = _logprobs_of(state, body, c.logprobs)
            reply = job.reply(c.text, c.finish_reason)
            calls = [tool_call(*call) for call in reply.calls]
            finish = _finish(c.finish_reason, bool(calls))
            out.append(chat_choice(c.index, reply.content, lp, finish, calls, reply.reasoning))
        return chat_response(meta, out, use)

    return await collect_response(request, job.run, build)


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


def _delta(events: list[ReplyEvent]) -> dict[str, Any]:
    """One chunk's delta: the thinking under both names clients read (vLLM's reasoning_content, and
    reasoning as vLLM's newer releases and Ollama write it), the answer, and tool-call pieces."""
    delta: dict[str, Any] = {}
    reasoning = "".join(e.text for e in events if isinstance(e, TextPiece) and e.kind == "reasoning")
    content = "".join(e.text for e in events if isinstance(e, TextPiece) and e.kind == "content")
    if reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    calls = [
        tool_call_delta(e.index, call_id=e.id, name=e.name)
        if isinstance(e, ToolCallStart)
        else tool_call_delta(e.index, arguments=e.text)
        for e in events
        if not isinstance(e, TextPiece)
    ]
    if calls:
        delta["tool_calls"] = calls
    return delta


def _stream(state: ServerState, job: ChatJob, meta: ResponseMeta) -> AsyncIterator[dict[str, Any]]:
    body, run = job.body, job.run
    # The first chunk of every choice carries the role, as OpenAI's do.
    roles = [chat_chunk_choice(s.index, {"role": "assistant", "content": ""}) for s in run.specs]
    parsers: dict[int, ReplyParser] = {s.index: job.parser() for s in run.specs}

    def choice(d: ChoiceDelta) -> dict[str, Any]:
        lp = _logprobs_of(state, body, d.logprobs)
        parser = parsers[d.index]
        events = parser.feed(d.text)
        if d.finish_reason is not None:
            events += parser.finish(d.finish_reason)
        return chat_chunk_choice(d.index, _delta(events), lp, _finish(d.finish_reason, parser.num_calls > 0))

    chunk = partial(stream_chunk, meta, "chat.completion.chunk", with_usage=body.include_usage)
    return stream_chunks(run, roles, choice, chunk, body.include_usage)
