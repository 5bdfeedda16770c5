"""Overlapped scheduling, the worker thread's half: a step's carried rows get their tokens.

While step N runs, the loop schedules step N+1 (Scheduler.schedule(pending=N)): a request decoding in
N continues in N+1 with a row whose token id is PENDING_TOKEN, since only N's sampling knows it. Steps
run one after another in the loop's worker thread, so when N+1 is about to be submitted there, N's
tokens are there too: `resolve` puts each one in its row (and at the end of the row's outputs, which
the sampler's penalties and seeds read), right before the forward. The event loop may be appending
N's tokens to the same requests' output lists meanwhile: a carried row reads only the outputs it was
scheduled with, then its own token (`CarriedOutputs`).

A row is dropped instead where N gave no token for it (N failed: its requests have failed) or its
request has finished meanwhile (N's token ended it, or it was aborted): nothing would use its token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import islice
from typing import overload

from engine.contract import (
    CARRIED_PLACEHOLDER,
    PENDING_TOKEN,
    SampledToken,
    ScheduledSequence,
    StepResult,
    is_carried,
)
from scheduler.core import ScheduledStep
from scheduler.request import Request


class CarriedOutputs(Sequence[int]):
    """The first `n` of a request's output ids (its live list, which only grows), then `last`."""

    __slots__ = ("_base", "_n", "_last")

    def __init__(self, base: Sequence[int], n: int, last: int) -> None:
        self._base = base
        self._n = n
        self._last = last

    def __len__(self) -> int:
        return self._n + 1

    def __iter__(self) -> Iterator[int]:
        yield from islice(self._base, self._n)
        yield self._last

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n + 1)
            if step != 1:
                return list(self)[i]
            out = list(
                self._base[start : min(stop, self._n)]
            )  # what the grammar matcher reads: its new tokens
            if start <= self._n < stop:
                out.append(self._last)
            return out
        if i < 0:
            i += self._n + 1
        if not 0 <= i <= self._n:
            raise IndexError("output index out of range")
        return self._last if i == self._n else self._base[i]


def last_tokens(seqs: Sequence[ScheduledSequence], results: Sequence[StepResult]) -> dict[str, int]:
    """Each sampling row's last token (the one the request's next row runs), by request id."""
    out: dict[str, int] = {}
    for seq, tok in zip(seqs, results, strict=True):
        if isinstance(tok, SampledToken):
            out[seq.request_id] = tok.following[-1].token_id if tok.following else tok.token_id
    return out


def resolve(
    seqs: Sequence[ScheduledSequence], requests: Sequence[Request], tokens: dict[str, int]
) -> tuple[list[ScheduledSequence], list[int] | None]:
    """The rows to submit, with the pending tokens put in (`tokens`: from the step before, by request
    id), and the indices into `seqs` of the rows kept (None: all of them)."""
    out: list[ScheduledSequence] = []
    kept: list[int] = []
    for i, (seq, req) in enumerate(zip(seqs, requests, strict=True)):
        if is_carried(seq):
            tok = tokens.get(seq.request_id)
            if tok is None or req.is_finished:
                continue
            seq = _with_token(seq, tok)
        out.append(seq)
        kept.append(i)
    return out, (kept if len(kept) < len(seqs) else None)


def resolve_on_device(
    seqs: Sequence[ScheduledSequence], requests: Sequence[Request]
) -> tuple[list[ScheduledSequence], list[int] | None, list[int]]:
    """`resolve` for a step submitted before the step before has been collected (DeviceCarry): the
    carried rows hold CARRIED_PLACEHOLDER, whose token the executor puts in on the device, and their
    outputs end with PENDING_TOKEN (only their count is read: Executor.carries). Returns the rows to
    submit, the indices into `seqs` of those kept (None: all) and the indices into the rows to submit
    of the carried ones."""
    out: list[ScheduledSequence] = []
    kept: list[int] = []
    carried: list[int] = []
    for i, (seq, req) in enumerate(zip(seqs, requests, strict=True)):
        if is_carried(seq):
            if req.is_finished:
                continue
            carried.append(len(out))
            seq = _with_token(seq, CARRIED_PLACEHOLDER, PENDING_TOKEN)
        out.append(seq)
        kept.append(i)
    return out, (kept if len(kept) < len(seqs) else None), carried


def _with_token(seq: ScheduledSequence, tok: int, last_output: int | None = None) -> ScheduledSequence:
    """A carried row with its token `tok`, also at the end of its outputs (CarriedOutputs) unless
    `last_output` is given."""
    n = seq.start_position - len(seq.prompt_token_ids)  # outputs before the pending token
    # Made whole rather than by dataclasses.replace (7x slower): this runs between two forwards.
    # A carried row is a plain sampled decode: no prompt logprobs, no proposals.
    return ScheduledSequence(
        seq.request_id,
        (tok,),
        seq.start_position,
        seq.block_table,
        True,
        seq.sampling,
        seq.prompt_token_ids,
        CarriedOutputs(seq.output_token_ids, n, tok if last_output is None else last_output),
    )


def kept_rows(step: ScheduledStep, kept: Sequence[int]) -> ScheduledStep:
    """The step as the worker ran it: only the rows `kept` (the dropped ones are carried decodes)."""
    return replace(
        step,
        seqs=[step.seqs[i] for i in kept],
        requests=[step.requests[i] for i in kept],
        num_decode_tokens=step.num_decode_tokens - (len(step.seqs) - len(kept)),
    )
