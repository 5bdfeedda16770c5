"""Stop strings over streamed text: never emit a stop string, nor a prefix of one that may still match."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text as it is decoded; get back what is safe to emit.

    The text is cut at the earliest-starting occurrence of any stop string, whatever the chunking (a
    lagging client gets several tokens' text in one chunk; the cut must not depend on that). So text
    that may still begin a stop string is held back until later text decides, and a stop string
    that completed is not acted on while a longer one that starts earlier may still complete
    (stops "b" and "aba" on "ab": wait for the next character). The held text always starts at the
    earliest undecided position, so searching `held + new` finds every candidate.
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
