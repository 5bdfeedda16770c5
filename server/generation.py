"""From the loop's deltas to the deltas of one choice, and the merge of n choices into one stream.

The loop already hands out text: decoded, cut at stop strings and with the logprobs of exactly the
tokens in that text (scheduler.output_text). Here each delta only takes the shape routes format: token
strings for logprobs, the finish reason as OpenAI names it, usage counts. Streamed and non-streamed
responses both consume `generate_choice`, so the concatenated stream is the non-streamed text by
construction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine.contract import Pooling, SamplingParams
from scheduler.outputs import FinishReason, RequestDelta, SchedulerStats, TokenLogprob
from server.metrics import RequestTracker
from server.tokenizer import ServerTokenizer


class LoopClient(Protocol):
    """What the server needs from scheduler.loop.IterationLoop."""

    max_model_len: int
    hidden_size: int  # the length of an embedding

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]: ...

    def embed(
        self, prompt_ids: Sequence[int], pooling: Pooling, request_id: str
    ) -> AsyncIterator[RequestDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> SchedulerStats: ...


class GenerationError(Exception):
    """The engine failed or dropped the request; the message is safe to show the client."""


@dataclass
class LogprobEntry:
    token_id: int
    token: str  # the token's text (`bytes:\x..` for part of a character)
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int  # where the token's text starts in the choice's generated text


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" on the last delta of the choice
    stop_string: str | None = None  # with finish_reason "stop": the stop string that ended it, if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    # On the choice's first delta, with SamplingParams.prompt_logprobs (None for the first token).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class ChoiceSpec:
    """One choice to generate: the prompt, how to sample, and how to turn tokens into text.

    `stops` and `skip_special_tokens` are the route's say on the text; open_choices puts them into the
    request's SamplingParams (whatever `params` carries for them), where the loop applies them."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    skip_special_tokens: bool = True
    prompt_index: int = 0  # which of the request's prompts (the n choices of one prompt share it)

    def request_params(self) -> SamplingParams:
        """The SamplingParams the loop gets: `params` with this choice's stop strings."""
        return replace(self.params, stop=tuple(self.stops), skip_special_tokens=self.skip_special_tokens)


def open_choices(loop: LoopClient, specs: list[ChoiceSpec]) -> list[AsyncIterator[RequestDelta]]:
    """Submit every choice to the loop at once; the loop's ValueError (bad input) aborts those submitted."""
    streams: list[AsyncIterator[RequestDelta]] = []
    try:
        for spec in specs:
            streams.append(loop.generate(spec.prompt_ids, spec.request_params(), spec.request_id))
    except BaseException:
        for spec in specs[: len(streams)]:
            loop.abort(spec.request_id)
        raise
    return streams


async def generate_choice(
    tokenizer: ServerTokenizer,
    spec: ChoiceSpec,
    stream: AsyncIterator[RequestDelta],
    tracker: RequestTracker,
) -> AsyncIterator[ChoiceDelta]:
    """Deltas of one choice (`stream` from open_choices). Closing early aborts the request."""
    want_logprobs = spec.params.logprobs is not None
    prompt_tokens = len(spec.prompt_ids)
    try:
        async for delta in stream:
            if delta.finish_reason is FinishReason.ERROR:
                raise GenerationError(delta.error or "the engine failed while generating")
            if delta.finish_reason is FinishReason.ABORT:
                raise GenerationError("the request was aborted by the server")
            prompt_tokens = delta.num_prompt_tokens or prompt_tokens
            if delta.queue_time_s is not None:
                tracker.on_queue_time(delta.queue_time_s)
            tracker.on_tokens(len(delta.token_ids), prompt_tokens)
            out = ChoiceDelta(
                spec.index,
                delta.text,
                logprobs=_entries(tokenizer, delta.logprobs) if want_logprobs else [],
                prompt_tokens=prompt_tokens,
                completion_tokens=delta.num_output_tokens,
                cached_tokens=delta.num_cached_tokens,
                prompt_logprobs=delta.prompt_logprobs,
            )
            if delta.finish_reason is not None:
                out.finish_reason = "stop" if delta.finish_reason is FinishReason.STOP else "length"
                out.stop_string = delta.stop_string
                tracker.on_finish(delta.num_output_tokens, out.finish_reason)
                yield out
                return
            if out.text or out.logprobs or out.prompt_logprobs is not None:
                yield out
        raise GenerationError("the engine ended the request without a finish reason")
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _entries(tokenizer: ServerTokenizer, logprobs: list[TokenLogprob] | None) -> list[LogprobEntry]:
    return [
        LogprobEntry(
            lp.token_id, tokenizer.token_text(lp.token_id), lp.logprob, lp.top_logprobs, lp.text_offset
        )
        for lp in logprobs or ()
    ]


async def merge_choices(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave several choices' deltas as they come. Closing the merge closes (aborts) them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield item
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)
        finally:
            await _aclose(stream)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _aclose(stream: AsyncIterator[ChoiceDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
