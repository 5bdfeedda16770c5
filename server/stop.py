"""Stop strings over streamed text: never emit a stop string, nor a prefix of one that may still match."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text as it is decoded; get back what is safe to emit.

    Text that ends with a prefix of some stop string is held back until the next chunk says whether the
    stop string completes. Held text is always the longest suffix that is a prefix of a stop string, so
    a match can only start inside held text or new text: searching `held + new` finds every match.
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
        buf = self._held + text
        first = -1
        for stop in self._stops:
            pos = buf.find(stop)
            if pos != -1 and (first == -1 or pos < first):
                first, self.matched = pos, stop
        if first != -1:
            self._held = ""
            return buf[:first]
        keep = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held text, once no more text will come (the request ended without a match)."""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        return self._held

    def _longest_partial_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            # A suffix of buf that is a proper prefix of stop (a full match was ruled out above).
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
