"""Which stop sequence ended a reply. Anthropic's API reports it (stop_reason "stop_sequence" and the
sequence itself), while a choice's deltas only say "stop", for an EOS token and a stop string alike.

The choice's text is cut where the earliest stop string starts, so the text decoded for it (including
what came after the cut) continues, right at the cut, with the stop sequence that matched; after an EOS
token nothing follows the cut. `DecodedText` is the request's tokenizer with a tap on the detokenizer the
choice decodes with, and keeps that text. (One tap per request: Messages requests have one choice.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.tokenizer import IncrementalDetokenizer, ServerTokenizer


class _Tap:
    def __init__(self, inner: IncrementalDetokenizer, sink: list[str]) -> None:
        self._inner = inner
        self._sink = sink

    def step(self, token_id: int) -> str:
        piece = self._inner.step(token_id)
        self._sink.append(piece)
        return piece


class DecodedText:
    """A ServerTokenizer (everything delegated) that keeps the text its detokenizer produced."""

    def __init__(self, tokenizer: ServerTokenizer) -> None:
        self._tokenizer = tokenizer
        self._pieces: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def decode_stream(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> Any:
        return _Tap(self._tokenizer.decode_stream(prompt_ids, skip_special_tokens), self._pieces)

    def matched_stop(self, emitted: str, finish_reason: str | None, stops: Sequence[str]) -> str | None:
        """The stop sequence that cut a reply whose emitted text is `emitted`, or None."""
        if finish_reason != "stop":
            return None
        decoded = "".join(self._pieces)
        return next((s for s in stops if decoded.startswith(s, len(emitted))), None)
