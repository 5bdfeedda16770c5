"""Running one request's choices: admission, submission to the loop, the per-request deadline, and the
two ways a route consumes them (one JSON body, or an SSE stream of chunks) with their usage.

/v1/chat/completions and /v1/completions differ only in how a choice and a chunk look, which they pass in
as callables; everything about the choices' lifetime (aborting them however the response ends) is here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from scheduler.loop import LoopStoppedError
from scheduler.outputs import TokenLogprob
from server.errors import invalid
from server.generation import (
    ChoiceDelta,
    ChoiceSpec,
    GenerationError,
    LogprobEntry,
    LoopClient,
    generate_choice,
    merge_choices,
    open_choices,
)
from server.responses import usage
from server.routes.common import (
    ClientDisconnected,
    Deadline,
    abort_all,
    admit,
    cancel_on_disconnect,
    disconnected_response,
    loop_stopped_error,
    sse,
)
from server.state import ServerState
from server.tokenizer import ServerTokenizer

T = TypeVar("T")

# (choices, usage or None) -> one response chunk; a partial of responses.stream_chunk.
ChunkBuilder = Callable[[list[dict[str, Any]], dict[str, Any] | None], dict[str, Any]]


@dataclass
class ChoiceRun:
    """A request's choices, submitted to the loop and running under the request's deadline."""

    loop: LoopClient
    specs: list[ChoiceSpec]
    gens: list[AsyncIterator[ChoiceDelta]]
    deadline: Deadline
    prompt_tokens: int  # over all prompts, for usage
    send_timeout_s: float | None = None  # a stream's client that reads nothing this long is cut

    def abort(self) -> None:
        abort_all(self.loop, self.specs)


@dataclass
class UsageTally:
    """The usage of a request's choices from their deltas. Each prompt counts once however many
    choices it has (OpenAI's rule); its cached tokens are those of the choice that computed the most
    of it, i.e. what the cache held before this request (its other choices reuse that choice's blocks)."""

    specs: list[ChoiceSpec]
    prompt_tokens: int
    completion: dict[int, int] = field(default_factory=dict)  # choice index -> completion tokens
    cached: dict[int, int] = field(default_factory=dict)  # choice index -> cached prompt tokens

    def observe(self, d: ChoiceDelta) -> None:
        self.completion[d.index] = d.completion_tokens
        self.cached[d.index] = d.cached_tokens

    def usage(self) -> dict[str, Any]:
        per_prompt: dict[int, int] = {}
        for s in self.specs:
            if s.index in self.cached:
                seen = per_prompt.get(s.prompt_index, self.cached[s.index])
                per_prompt[s.prompt_index] = min(seen, self.cached[s.index])
        return usage(self.prompt_tokens, sum(self.completion.values()), sum(per_prompt.values()))


@dataclass
class CollectedChoice:
    """One choice generated to its end, for a non-streamed response."""

    index: int
    text: str
    logprobs: list[LogprobEntry]
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did


def start_choices(
    state: ServerState,
    loop: LoopClient,
    tokenizer: ServerTokenizer,
    specs: list[ChoiceSpec],
    prompt_tokens: int,
) -> ChoiceRun:
    """Admit the choices (429 on a full queue) and submit them; the deadline starts now."""
    admit(state, loop, len(specs))
    try:
        streams = open_choices(loop, specs)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    except LoopStoppedError as exc:
        raise loop_stopped_error(exc) from None
    deadline = Deadline(state, state.config.request_timeout_s)
    gens = [
        generate_choice(tokenizer, s, st, state.metrics.tracker())
        for s, st in zip(specs, streams, strict=True)
    ]
    return ChoiceRun(loop, specs, gens, deadline, prompt_tokens, state.config.stream_send_timeout_s)


async def collect_choices(run: ChoiceRun) -> tuple[list[CollectedChoice], dict[str, Any]]:
    """Every choice to its end, in index order, and the request's usage."""
    texts: dict[int, list[str]] = {s.index: [] for s in run.specs}
    entries: dict[int, list[LogprobEntry]] = {s.index: [] for s in run.specs}
    finish: dict[int, str | None] = {}
    stopped_by: dict[int, str | None] = {}
    tally = UsageTally(run.specs, run.prompt_tokens)
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
    try:
        async for d in merge_choices(run.gens):
            if d.prompt_logprobs is not None:
                prompt_logprobs[d.index] = d.prompt_logprobs
            texts[d.index].append(d.text)
            entries[d.index].extend(d.logprobs)
            tally.observe(d)
            if d.finish_reason is not None:
                finish[d.index], stopped_by[d.index] = d.finish_reason, d.stop_string
    finally:
        run.abort()
    choices = [
        CollectedChoice(
            s.index,
            "".join(texts[s.index]),
            entries[s.index],
            finish.get(s.index),
            prompt_logprobs.get(s.index),
            stopped_by.get(s.index),
        )
        for s in run.specs
    ]
    return choices, tally.usage()


async def stream_chunks(
    run: ChoiceRun,
    first: Iterable[dict[str, Any]],
    choice: Callable[[ChoiceDelta], dict[str, Any]],
    chunk: ChunkBuilder,
    with_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    """One chunk per choice in `first` (chat's role, completions' echo), then one per delta, then (with
    stream_options.include_usage) a last chunk with no choices and the usage."""
    tally = UsageTally(run.specs, run.prompt_tokens)
    try:
        for c in first:
            yield chunk([c], None)
        async for d in merge_choices(run.gens):
            tally.observe(d)
            yield chunk([choice(d)], None)
    finally:
        run.abort()
    if with_usage:
        yield chunk([], tally.usage())


def stream_response(run: ChoiceRun, events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    return sse(run.deadline.iterate(events), run.abort, run.send_timeout_s)


async def collect(
    request: Request,
    run: ChoiceRun,
    build: Callable[[list[CollectedChoice], dict[str, Any]], T],
) -> T | None:
    """The choices collected under the deadline and built into a body; None if the client left first
    (the choices are aborted then)."""

    async def body() -> T:
        choices, use = await collect_choices(run)
        return build(choices, use)

    try:
        return await cancel_on_disconnect(request, run.deadline.run(body()))
    except ClientDisconnected:
        run.abort()  # in case the work was cancelled before it started
        return None
    except (GenerationError, LoopStoppedError) as exc:
        raise loop_stopped_error(exc) from None


async def collect_response(
    request: Request,
    run: ChoiceRun,
    build: Callable[[list[CollectedChoice], dict[str, Any]], dict[str, Any]],
) -> Response:
    """The choices collected under the deadline into one JSON body; cancelled if the client leaves."""
    result = await collect(request, run, build)
    return disconnected_response() if result is None else JSONResponse(result)
