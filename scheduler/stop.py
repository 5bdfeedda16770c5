"""The stop rules, all of them: token ids (EOS, stop_token_ids), lengths (max_tokens, the maximum
length) and stop strings. Checked after every sampled token, in the scheduler's update step, so a
request that stops frees its KV blocks before the next iteration is scheduled."""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Protocol

from engine.contract import SamplingParams
from scheduler.outputs import FinishReason


class _OutputEnd(Protocol):
    """What the rules read of a request's output text (scheduler.output_text.OutputText)."""

    @property
    def stopped(self) -> bool: ...

    def close(self) -> bool: ...


class StoppableRequest(Protocol):
    """What the stop rules read of a request (scheduler.request.Request, which imports this module
    through output_text.py: a Protocol keeps the two apart)."""

    output_token_ids: list[int]
    sampling: SamplingParams
    output_text: _OutputEnd

    @property
    def num_tokens(self) -> int: ...


def check_stop(req: StoppableRequest, eos_token_ids: Set[int], max_model_len: int) -> FinishReason | None:
    """Why the request's newest token (already added to `req.output_text`) ends it, or None to go on.

    A stop string wins over the other rules: its text is cut there whatever else the token did.
    EOS and stop ids count only once min_tokens are out; the stopping token itself stays in the
    output (like vLLM's token ids), and its text is left out only where it is a special token.
    When another rule ends the request its text ends too (`OutputText.close`): a stop string that
    completed while a longer one that starts earlier was still possible is applied then.
    """
    output = req.output_text
    if output.stopped:
        return FinishReason.STOP
    reason = _token_rules(req, eos_token_ids, max_model_len)
    if reason is not None and output.close():
        return FinishReason.STOP
    return reason


def _token_rules(req: StoppableRequest, eos_token_ids: Set[int], max_model_len: int) -> FinishReason | None:
    n_out = len(req.output_token_ids)
    last = req.output_token_ids[-1]
    params = req.sampling
    if n_out >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if n_out >= params.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class StopStringMatcher:
    """Feed text as it is decoded; get back what is safe to emit: never a stop string, nor a prefix of
    one that may still match.

    The text is cut at the earliest-starting occurrence of any stop string, whatever the chunking (the
    cut must not depend on how many tokens' text arrives at once). So text that may still begin a stop
    string is held back until later text decides, and a stop string that completed is not acted on
    while a longer one that starts earlier may still complete (stops "b" and "aba" on "ab": wait for
    the next character). The held text always starts at the earliest undecided position, so searching
    `held + new` finds every candidate.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Safe text to emit now. After a match, `matched` is set and later calls return ""."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        return self._scan(self._held + text, final=False)

    def flush(self) -> str:
        """The rest, once no more text will come: the held text, cut at a stop string that completed
        while a longer candidate was pending (then `matched` is set)."""
        if self.matched is not None or not self._held:
            self._held = ""
            return ""
        return self._scan(self._held, final=True)

    @property
    def held(self) -> str:
        return self._held

    def _scan(self, buf: str, final: bool) -> str:
        first, stop = self._earliest_match(buf)
        limit = len(buf) if first is None else first
        pending = None if final else self._earliest_partial(buf, limit)
        if first is not None and pending is None:
            self.matched, self._held = stop, ""
            return buf[:first]
        cut = len(buf) if pending is None else pending
        self._held = buf[cut:]
        return buf[:cut]

    def _earliest_match(self, buf: str) -> tuple[int | None, str | None]:
        first: int | None = None
        found: str | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos != -1 and (first is None or pos < first):
                first, found = pos, stop
        return first, found

    def _earliest_partial(self, buf: str, limit: int) -> int | None:
        """The earliest start p < limit of a suffix buf[p:] that is a proper prefix of a stop string
        (a match that more text may complete)."""
        longest = max(len(s) for s in self._stops)
        for p in range(max(0, len(buf) - longest + 1), min(limit, len(buf))):
            tail = buf[p:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self._stops):
                return p
        return None
