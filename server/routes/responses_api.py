"""OpenAI's Responses API: POST /v1/responses (one JSON body, a typed event stream, or a background
run), GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request is translated into the shared chat path (server/responses_api/convert.py) and its reply written
out as output items (server/reply_blocks.py, server/responses_api/events.py). A stored response keeps the
conversation it ends, so `previous_response_id` continues it: the new prompt renders the same messages
first, so it extends the previous prompt's tokens and the prefix cache serves that part.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import APIError, invalid
from server.reply import TextPiece
from server.reply_blocks import Block, BlockSequencer, blocks_of
from server.responses_api.convert import (
    PARAMS,
    assistant_turn,
    chat_request,
    check_supported,
    input_messages,
    new_response_id,
    output_item,
    reply_of,
    response_object,
    usage_of,
)
from server.responses_api.events import ResponseEvents
from server.responses_api.protocol import ResponsesRequest
from server.routes.chat_job import ChatJob, reasoning_tokens, start_chat
from server.routes.common import (
    SSEDialect,
    disconnected_response,
    failure,
    get_state,
    ready_for,
    sse,
)
from server.routes.fanout import CollectedChoice, UsageTally, collect, collect_choices
from server.state import ServerState
from server.translate import client_params

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


def _error_event(err: APIError) -> dict[str, Any]:
    # Only reached if writing the stream itself fails: generation errors end it with response.failed.
    return {
        "type": "error",
        "code": err.code,
        "message": err.message,
        "param": err.param,
        "sequence_number": 0,
    }


RESPONSES_SSE = SSEDialect(named=True, done=False, error_body=_error_event)


def not_found(response_id: str, param: str | None = None) -> APIError:
    code = "previous_response_not_found" if param else None
    return APIError(
        f"Response with id '{response_id}' not found.",
        HTTPStatus.NOT_FOUND,
        "invalid_request_error",
        param,
        code,
    )


@dataclass
class _Turn:
    """One response being made: what its result objects repeat, and where it is stored."""

    state: ServerState
    body: ResponsesRequest
    job: ChatJob
    response_id: str
    created_at: float
    conversation: list[dict[str, Any]]  # the chat messages before the reply (the instructions aside)

    def response(
        self,
        status: str,
        blocks: list[Block],
        usage: dict[str, Any] | None = None,
        error: APIError | None = None,
    ) -> dict[str, Any]:
        output = [output_item(self.response_id, b) for b in blocks]
        model = self.state.config.model_name
        return response_object(
            self.response_id, self.created_at, self.body, model, status, output, usage, error
        )

    def final(self, blocks: list[Block], finish_reason: str | None, use: dict[str, Any]) -> dict[str, Any]:
        assert self.state.tokenizer is not None
        thought = "".join(b.text for b in blocks if b.kind == "reasoning")
        usage = usage_of(use, reasoning_tokens(self.state.tokenizer, thought))
        return self.response("incomplete" if finish_reason == "length" else "completed", blocks, usage)

    def from_choices(
        self, choices: list[CollectedChoice], use: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Block]]:
        (c,) = choices
        blocks = blocks_of(self.job.reply(c.text, c.finish_reason), c.finish_reason)
        if not any(b.kind != "reasoning" for b in blocks):  # the answer, even empty, is a message item
            blocks.append(Block("text", len(blocks), closed=True, complete=c.finish_reason != "length"))
        return self.final(blocks, c.finish_reason, use), blocks

    async def cancelled(self) -> None:
        """A background response cancelled (by the client or at shutdown): its choice is aborted."""
        self.job.run.abort()
        await self.keep(self.response("cancelled", []), None)

    async def keep(self, response: dict[str, Any], blocks: list[Block] | None) -> None:
        """Store the response (store: true) with its conversation; `blocks` None: no reply yet."""
        if self.body.store is False:
            return
        turn = [] if blocks is None else [assistant_turn(reply_of(blocks))]
        await self.state.response_store.put(response, [*self.conversation, *turn])


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    check_supported(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await state.response_store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = previous.messages
    conversation = [*history, *input_messages(body)]
    response_id = new_response_id()
    with client_params(PARAMS):
        job = await start_chat(state, loop, tokenizer, chat_request(body, conversation), response_id)
    turn = _Turn(state, body, job, response_id, time.time(), conversation)
    if body.background:
        queued = turn.response("queued", [])
        await turn.keep(queued, None)
        state.background.start(response_id, _run_in_background(turn), turn.cancelled)
        return JSONResponse(queued)
    if body.stream:
        return sse(_stream(turn), job.run.abort, job.run.send_timeout_s, RESPONSES_SSE)
    result = await collect(request, job.run, turn.from_choices)
    if result is None:
        return disconnected_response()
    response, blocks = result
    await turn.keep(response, blocks)
    return JSONResponse(response)


async def _stream(turn: _Turn) -> AsyncIterator[dict[str, Any]]:
    events = ResponseEvents(turn.response_id)
    yield events.lifecycle("created", turn.response("in_progress", []))
    yield events.lifecycle("in_progress", turn.response("in_progress", []))
    seq = BlockSequencer()
    tally = UsageTally(turn.job.run.specs, turn.job.run.prompt_tokens)
    finish: str | None = None
    try:
        async with contextlib.aclosing(turn.job.updates(tally)) as updates:  # closing it aborts the choice
            async for update in updates:
                for event in events.ops(seq.push(update.events)):
                    yield event
                finish = update.finish_reason or finish
        ops = [] if any(b.kind != "reasoning" for b in seq.blocks) else seq.push([TextPiece("content", "")])
        for event in events.ops(ops + seq.close(finish)):
            yield event
        final = turn.final(seq.blocks, finish, tally.usage())
        await turn.keep(final, seq.blocks)
        yield events.lifecycle(final["status"], final)
    except Exception as exc:
        failed = turn.response("failed", seq.blocks, error=failure(exc))
        await turn.keep(failed, seq.blocks)
        yield events.lifecycle("failed", failed)


async def _run_in_background(turn: _Turn) -> None:
    run = turn.job.run
    try:
        await turn.keep(turn.response("in_progress", []), None)
        choices, use = await run.deadline.run(collect_choices(run))
        await turn.keep(*turn.from_choices(choices, use))
    except Exception as exc:
        run.abort()
        await turn.keep(turn.response("failed", [], error=failure(exc)), None)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = await get_state(request).response_store.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    state = get_state(request)
    await state.background.cancel(response_id)
    if not await state.response_store.delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, request: Request) -> Response:
    state = get_state(request)
    stored = await state.response_store.get(response_id)
    if stored is None:
        raise not_found(response_id)
    if not stored.response.get("background"):
        raise invalid("Only responses created with background set to true can be cancelled.")
    if await state.background.cancel(response_id):
        stored = await state.response_store.get(response_id)
        assert stored is not None
    elif stored.response["status"] != "cancelled":  # cancelling twice returns the cancelled response
        raise invalid(f"Cannot cancel a response whose status is {stored.response['status']!r}.")
    return JSONResponse(stored.response)
