"""What the generation routes share: state lookup, model, limit and context checks, admission (queue
bound, draining), sampling params, per-request deadlines, cancellation on client disconnect, and SSE
framing."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from engine.contract import SamplingParams
from engine.grammar import CompiledGrammar
from scheduler.loop import LoopStoppedError
from server.errors import (
    APIError,
    context_length_exceeded,
    draining,
    invalid,
    model_not_found,
    queue_full,
    request_timeout,
)
from server.generation import ChoiceSpec, GenerationError, LoopClient
from server.protocol import SamplingFields
from server.state import ServerState
from server.tokenizer import ServerTokenizer

if sys.version_info < (3, 11):  # anyio's backport on 3.10
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Prompts longer than this (characters) are tokenized / rendered in a worker thread: the event loop
# keeps streaming other requests' tokens meanwhile. Short ones are cheaper inline than a thread hop.
OFFLOAD_CHARS = 4096


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def check_limits(
    state: ServerState,
    *,
    n: int,
    num_prompts: int,
    logprobs: int | None,
    num_stops: int,
    max_tokens: int | None,
    logprobs_param: str = "logprobs",
) -> None:
    """The server's caps on what one request may ask for (the protocol's bounds are wider)."""
    cfg = state.config
    if n > cfg.max_n:
        raise invalid(f"n must be at most {cfg.max_n} on this server, got {n}.", param="n")
    if n * num_prompts > cfg.max_choices:
        raise invalid(
            f"A request may ask for at most {cfg.max_choices} choices (prompts x n), got {n * num_prompts}.",
            param="n" if num_prompts == 1 else "prompt",
        )
    if logprobs is not None and logprobs > cfg.max_logprobs:
        raise invalid(
            f"{logprobs_param} must be at most {cfg.max_logprobs} on this server.", param=logprobs_param
        )
    if num_stops > cfg.max_stop_strings:
        raise invalid(f"At most {cfg.max_stop_strings} stop sequences are allowed.", param="stop")
    if max_tokens is not None and cfg.max_tokens is not None and max_tokens > cfg.max_tokens:
        raise invalid(f"max_tokens must be at most {cfg.max_tokens} on this server.", param="max_tokens")


def check_draining(state: ServerState) -> None:
    if state.draining:
        state.metrics.count_rejected("draining")
        raise draining(state.config.retry_after_s)


def admit(state: ServerState, loop: LoopClient, num_choices: int) -> None:
    """Refuse a request (429 + Retry-After) whose choices would overflow the waiting queue. Checked and
    followed by generate() in the same event-loop turn, so concurrent requests cannot overshoot."""
    check_draining(state)
    limit = state.config.max_queue_len
    if limit is None:
        return
    waiting = loop.stats().waiting
    if waiting + num_choices > limit:
        state.metrics.count_rejected("queue_full")
        logger.warning("queue full (%d waiting, limit %d): refusing %d choices", waiting, limit, num_choices)
        raise queue_full(limit, state.config.retry_after_s)


def check_model(state: ServerState, name: str | None) -> None:
    # A missing model means the one served (vLLM does the same); any other name is a 404.
    if name is not None and name != state.config.model_name:
        raise model_not_found(name)


def ready_for(request: Request, model: str | None) -> tuple[ServerState, LoopClient, ServerTokenizer]:
    """What a generation route checks before reading its body further: a loaded model (503 while
    loading), a server taking requests (503 while draining), and the model it names (404)."""
    state = get_state(request)
    loop, tokenizer = state.require_ready()
    check_draining(state)
    check_model(state, model)
    return state, loop, tokenizer


async def offload(fn: Callable[..., T], *args: Any, size: int) -> T:
    return await asyncio.to_thread(fn, *args) if size > OFFLOAD_CHARS else fn(*args)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise invalid(f"token id {bad[0]} is out of range (vocabulary size {vocab_size})", param=param)


def check_context(max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise context_length_exceeded(max_model_len, prompt_tokens, max_tokens)


def sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """SamplingParams for choice 0 (choice i gets seed + i, see choice_specs)."""
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true.", param="stream_options")
    logit_bias = {int(k): v for k, v in (body.logit_bias or {}).items()} or None
    if logit_bias:
        check_token_ids(list(logit_bias), vocab_size, "logit_bias")
    stop_ids = tuple(body.stop_token_ids or ())
    check_token_ids(list(stop_ids), vocab_size, "stop_token_ids")
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),  # -1 (vLLM's "off") and 0 mean the same
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=logit_bias,
        seed=body.seed,
        logprobs=logprobs,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.ignore_eos),
    )


def choice_specs(
    request_prefix: str,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    stops: list[str],
    skip_special_tokens: bool,
    grammar: CompiledGrammar | None = None,
) -> list[ChoiceSpec]:
    """n choices per prompt, indexed prompt-major as OpenAI does. With a seed, choice j uses seed + j:
    the same seed for all n would make the n choices identical. With a grammar, each choice gets its
    own matcher (its own position in the grammar)."""
    specs = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            seeded = params if params.seed is None else replace(params, seed=params.seed + j)
            if grammar is not None:
                seeded = replace(seeded, grammar=grammar.new_matcher())
            specs.append(
                ChoiceSpec(index, f"{request_prefix}-{index}", prompt, seeded, stops, skip_special_tokens, p)
            )
    return specs


def abort_all(loop: LoopClient, specs: list[ChoiceSpec]) -> None:
    """Idempotent: requests already finished are left alone by the loop."""
    for spec in specs:
        loop.abort(spec.request_id)


def loop_stopped_error(exc: Exception) -> APIError:
    if isinstance(exc, GenerationError):
        return APIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR, "server_error", None, "generation_failed")
    return APIError(f"The engine is not running: {exc}", HTTPStatus.SERVICE_UNAVAILABLE, "server_error")


def failure(exc: Exception) -> APIError:
    """What a stream that already started reports when its generation fails (a bug is logged too)."""
    if isinstance(exc, APIError):
        return exc
    if not isinstance(exc, (GenerationError, LoopStoppedError)):
        logger.exception("stream failed")
    return loop_stopped_error(exc)


class Deadline:
    """The server's per-request timeout, from the request's admission to its last token. Work run
    through it is cancelled when the time is up, which closes the choices' streams (so the loop
    aborts them) even while a step is in flight; the client gets a 408, or an error event mid-stream."""

    def __init__(self, state: ServerState, timeout_s: float | None) -> None:
        self._state = state
        self.timeout_s = timeout_s
        self._end = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    def _remaining(self) -> float | None:
        return None if self._end is None else max(self._end - asyncio.get_running_loop().time(), 0.0)

    def _expired(self) -> APIError:
        assert self.timeout_s is not None
        self._state.metrics.count_rejected("timeout")
        logger.warning("request timed out after %g s; aborted", self.timeout_s)
        return request_timeout(self.timeout_s)

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        try:
            return await asyncio.wait_for(work, self._remaining())
        except asyncio.TimeoutError:
            raise self._expired() from None

    async def iterate(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """`events`, each one awaited under the time left; closing this closes `events`."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(anext(events), self._remaining())
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise self._expired() from None
                yield item
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


class ClientDisconnected(Exception):
    pass


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests in the loop)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body is read already, so the next ASGI message is http.disconnect, whenever it comes.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return task.result()


def disconnected_response() -> Response:
    # Nobody reads it; 499 is nginx's "client closed request", which is what access logs should say.
    return Response(status_code=499)


@dataclass(frozen=True)
class SSEDialect:
    """How an API frames its stream. OpenAI's chat and completions: `data:` lines only, ending with
    `data: [DONE]`. OpenAI's Responses and Anthropic's Messages: each event also named on an `event:`
    line (its "type"; the SDKs dispatch on it), and no [DONE]."""

    named: bool = False
    done: bool = True
    error_body: Callable[[APIError], dict[str, Any]] = APIError.body


OPENAI_SSE = SSEDialect()


def sse(
    events: AsyncIterator[dict[str, Any] | str],
    cleanup: Callable[[], None],
    send_timeout_s: float | None = None,
    dialect: SSEDialect = OPENAI_SSE,
) -> EventSourceResponse:
    """`data: {json}` events, then `data: [DONE]` (see SSEDialect). An error mid-stream arrives as an
    event holding the API's error object (the status line is long gone), followed by [DONE]. `cleanup`
    runs once the response is over however it ended: a client gone before the first event never starts
    `events`, so their own `finally` would not run. A send that waits `send_timeout_s` (the client reads
    nothing and every buffer on the way is full) ends the stream: see SlowClientStream."""

    async def after() -> None:
        cleanup()

    def frame(event: dict[str, Any] | str) -> dict[str, str]:
        if isinstance(event, str):
            return {"data": event}
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return {"event": event["type"], "data": data} if dialect.named else {"data": data}

    async def frames() -> AsyncIterator[dict[str, str]]:
        try:
            async for event in events:
                yield frame(event)
        except APIError as exc:
            yield frame(dialect.error_body(exc))
        except Exception as exc:  # GenerationError, LoopStoppedError, or a bug: the client must hear of it
            if not isinstance(exc, GenerationError):
                logger.exception("stream failed")
            yield frame(dialect.error_body(loop_stopped_error(exc)))
        if dialect.done:
            yield {"data": "[DONE]"}

    # Pings are SSE comments (": ping"), which every SSE parser (the openai client's included) skips;
    # they keep proxies from closing a stream whose prefill takes long.
    return SlowClientStream(
        frames(), sep="\n", ping=15, background=BackgroundTask(after), send_timeout=send_timeout_s
    )


class SlowClientStream(EventSourceResponse):
    """An SSE response that ends when its client stops reading.

    What buffers a stream: uvicorn writes each event to the asyncio transport and, once the transport
    holds more than its high-water mark (64 KiB), makes the next send wait until it drains; below
    that is the kernel's socket send buffer (autotuned, up to net.ipv4.tcp_wmem's maximum) and the
    client's receive buffer. Nothing else queues: sse-starlette sends each event as the generator
    yields it, so a blocked send stops the generator, and the engine's deltas for the request merge
    into one (scheduler.loop) instead of piling up. What a client that never reads would pin is its
    request: a batch slot and KV blocks until max_tokens. sse-starlette's send_timeout turns a send
    blocked that long into SendTimeoutError; the generator is closed, which aborts the request in the
    loop, and the connection is dropped (uvicorn closes it once the app returns)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            logger.warning("the client read nothing for %g s; stream aborted", self.send_timeout)
        except BaseExceptionGroup as group:  # raised from sse-starlette's task group
            rest = group.subgroup(lambda e: not isinstance(e, SendTimeoutError))
            if rest is not None:
                raise rest from None
            logger.warning("the client read nothing for %g s; stream aborted", self.send_timeout)
