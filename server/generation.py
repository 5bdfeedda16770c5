"""From the loop's token deltas to text deltas for one choice: incremental detokenization, stop strings,
logprobs aligned with the text that is actually emitted, and the merge of n choices into one stream.

Streamed and non-streamed responses both consume `generate_choice`, so the concatenated stream is the
non-streamed text by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.contract import SamplingParams
from scheduler.outputs import FinishReason, RequestDelta, SchedulerStats, TokenLogprob
from server.metrics import RequestTracker
from server.stop_strings import StopStringMatcher
from server.tokenizer import ServerTokenizer


class LoopClient(Protocol):
    """What the server needs from scheduler.loop.IterationLoop."""

    max_model_len: int

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str) -> None: ...

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
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    # On the choice's first delta, with SamplingParams.prompt_logprobs (None for the first token).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class ChoiceSpec:
    """One choice to generate: the prompt, how to sample, and how to turn tokens into text."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    skip_special_tokens: bool = True
    prompt_index: int = 0  # which of the request's prompts (the n choices of one prompt share it)


def open_choices(loop: LoopClient, specs: list[ChoiceSpec]) -> list[AsyncIterator[RequestDelta]]:
    """Submit every choice to the loop at once; the loop's ValueError (bad input) aborts those submitted."""
    streams: list[AsyncIterator[RequestDelta]] = []
    try:
        for spec in specs:
            streams.append(loop.generate(spec.prompt_ids, spec.params, spec.request_id))
    except BaseException:
        for spec in specs[: len(streams)]:
            loop.abort(spec.request_id)
        raise
    return streams


async def generate_choice(
    loop: LoopClient,
    tokenizer: ServerTokenizer,
    spec: ChoiceSpec,
    stream: AsyncIterator[RequestDelta],
    tracker: RequestTracker,
) -> AsyncIterator[ChoiceDelta]:
    """Text deltas of one choice (`stream` from open_choices). Closing early aborts the request."""
    detok = tokenizer.decode_stream(spec.prompt_ids, spec.skip_special_tokens)
    matcher = StopStringMatcher(spec.stops)
    want_logprobs = spec.params.logprobs is not None
    decoded_len = 0  # characters decoded so far, held-back text included
    emitted_len = 0  # characters sent to the client
    pending: list[LogprobEntry] = []  # logprobs of tokens whose text is not fully emitted yet
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
            pieces = []
            for i, token_id in enumerate(delta.token_ids):
                if want_logprobs and delta.logprobs is not None:
                    lp = delta.logprobs[i]
                    pending.append(
                        LogprobEntry(
                            token_id, tokenizer.token_text(token_id), lp.logprob, lp.top_logprobs, decoded_len
                        )
                    )
                piece = detok.step(token_id)
                decoded_len += len(piece)
                pieces.append(piece)
            text = matcher.feed("".join(pieces))
            emitted_len += len(text)
            out = ChoiceDelta(
                spec.index,
                text,
                prompt_tokens=prompt_tokens,
                completion_tokens=delta.num_output_tokens,
                cached_tokens=delta.num_cached_tokens,
                prompt_logprobs=delta.prompt_logprobs,
            )
            if matcher.matched is not None:
                # Tokens that start after the cut belong to the stop string: they are not reported.
                out.logprobs = [e for e in pending if e.text_offset < emitted_len]
                out.finish_reason = "stop"
                loop.finish(spec.request_id)
                tracker.on_finish(delta.num_output_tokens, out.finish_reason)
                yield out
                return
            if delta.finish_reason is not None:
                tail = matcher.flush()
                out.text += tail
                emitted_len += len(tail)
                if matcher.matched is not None:
                    # A stop string had completed but waited on a longer one that began earlier.
                    out.logprobs = [e for e in pending if e.text_offset < emitted_len]
                    out.finish_reason = "stop"
                else:
                    out.logprobs = pending
                    out.finish_reason = "stop" if delta.finish_reason is FinishReason.STOP else "length"
                tracker.on_finish(delta.num_output_tokens, out.finish_reason)
                yield out
                return
            # Nothing held back: every token so far is accounted for in emitted text.
            ready = (
                len(pending) if not matcher.held else sum(1 for e in pending if e.text_offset < emitted_len)
            )
            out.logprobs, pending = pending[:ready], pending[ready:]
            if out.text or out.logprobs or out.prompt_logprobs is not None:
                yield out
        raise GenerationError("the engine ended the request without a finish reason")
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


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
