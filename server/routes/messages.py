"""Anthropic's Messages API: POST /v1/messages (one message, or its event stream) and
POST /v1/messages/count_tokens. A request is translated into the shared chat path
(server/anthropic/convert.py) and its reply written out as content blocks (server/reply_blocks.py,
server/anthropic/events.py). Errors on these routes take Anthropic's shape (server/errors.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.anthropic.convert import (
    PARAMS,
    chat_request,
    content_block,
    message_object,
    new_message_id,
    stop_reason,
    usage_of,
)
from server.anthropic.events import block_events, message_delta
from server.anthropic.protocol import CountTokensRequest, MessagesRequest
from server.errors import APIError
from server.reply_blocks import BlockSequencer, blocks_of
from server.routes.chat_job import ChatJob, render_prompt, start_chat, template_kwargs
from server.routes.common import SSEDialect, disconnected_response, failure, ready_for, sse
from server.routes.fanout import CollectedChoice, UsageTally, collect
from server.tools import plan_tools
from server.translate import client_params

router = APIRouter()  # the API key (Authorization or x-api-key) is checked by APIKeyMiddleware

MESSAGES_SSE = SSEDialect(named=True, done=False, error_body=APIError.anthropic_body)


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    chat = chat_request(body)
    message_id = new_message_id()
    with client_params(PARAMS):
        job = await start_chat(state, loop, tokenizer, chat, message_id)
    model = state.config.model_name
    if body.stream:
        return sse(
            _stream(job, message_id, model),
            job.run.abort,
            job.run.send_timeout_s,
            MESSAGES_SSE,
        )

    def build(choices: list[CollectedChoice], use: dict[str, Any]) -> dict[str, Any]:
        (c,) = choices
        reply = job.reply(c.text, c.finish_reason)
        content = [content_block(b) for b in blocks_of(reply, c.finish_reason)]
        reason = stop_reason(c.finish_reason, bool(reply.calls), c.stop_string)
        return message_object(message_id, model, content, reason, c.stop_string, usage_of(use))

    result = await collect(request, job.run, build)
    return disconnected_response() if result is None else JSONResponse(result)


async def _stream(job: ChatJob, message_id: str, model: str) -> AsyncIterator[dict[str, Any]]:
    prompt_tokens = len(job.prompt)
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0}
    start = message_object(message_id, model, [], None, None, usage)
    yield {"type": "message_start", "message": start}
    yield {"type": "ping"}
    seq = BlockSequencer()
    tally = UsageTally(job.run.specs, job.run.prompt_tokens)
    finish: str | None = None
    stop: str | None = None
    try:
        async with contextlib.aclosing(job.updates(tally)) as updates:  # closing it aborts the choice
            async for update in updates:
                for event in block_events(seq.push(update.events)):
                    yield event
                finish, stop = update.finish_reason or finish, update.stop_string or stop
        for event in block_events(seq.close(finish)):
            yield event
        reason = stop_reason(finish, any(b.kind == "call" for b in seq.blocks), stop)
        yield message_delta(reason, stop, usage_of(tally.usage()))
        yield {"type": "message_stop"}
    except Exception as exc:
        yield failure(exc).anthropic_body()


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it (tools included)."""
    state, _, tokenizer = ready_for(request, body.model)
    chat = chat_request(body)
    with client_params(PARAMS):
        plan = plan_tools(chat, tokenizer.chat_template)
        _, ids = await render_prompt(tokenizer, chat.messages, True, plan, template_kwargs(chat))
    return JSONResponse({"input_tokens": len(ids)})
