"""One request's output as the client sees it: its tokens decoded to text one at a time, the text cut
at a stop string (and held back while it may still become one), and the logprobs of exactly the tokens
whose text is emitted.

It runs where the loop applies a step's tokens (Scheduler.update), so a stop string ends the request in
the iteration that produced it, like EOS. The tokenizer stays the server's: this module sees it only
through the torch-free `Detokenizer` protocol (server.tokenizer.ServerTokenizer implements it with
tokenizers' DecodeStream; scheduler.fake_runner.FakeDetokenizer in tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from engine.contract import SamplingParams
from scheduler.outputs import TokenLogprob
from scheduler.stop import StopStringMatcher


class IncrementalDecoder(Protocol):
    """One request's detokenizer: the new text each next token adds. It must never split a multi-byte
    character (text whose bytes are incomplete waits for the token that completes it)."""

    def step(self, token_id: int) -> str: ...


class Detokenizer(Protocol):
    """Makes a request's IncrementalDecoder; `prompt_ids` are context for decoders whose text depends
    on the token before (SentencePiece's leading space)."""

    def decode_stream(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> IncrementalDecoder: ...


class _NoText:
    """The decoder of a loop without a tokenizer (benchmarks, the load tester's fake server): tokens only."""

    def step(self, token_id: int) -> str:
        return ""


_NO_TEXT = _NoText()


def start_output(
    detokenizer: Detokenizer | None, prompt_ids: Sequence[int], params: SamplingParams
) -> OutputText:
    """A new request's OutputText. Raises ValueError (at admission) for stop strings that a loop without
    a detokenizer could never see."""
    if detokenizer is None:
        if params.stop:
            raise ValueError("stop strings need a detokenizer, and this loop has none")
        return OutputText.without_text()
    return OutputText(detokenizer.decode_stream(prompt_ids, params.skip_special_tokens), params.stop)


class OutputText:
    """Feed each sampled token (`add`), end the text (`close`) when another rule stops the request, and
    `take` what is ready to hand out since the last take.

    A token's logprob belongs to the emitted text once the text before it is emitted and none of its
    own is held back (or it decoded to nothing while nothing is held); after a stop string's cut, the
    tokens whose text starts at or after the cut belong to the stop string and are never reported. Each
    entry carries `text_offset`, where the token's text starts in the request's text (OpenAI's
    text_offset). Token by token, so what is emitted does not depend on how a consumer reads it.
    """

    def __init__(self, decoder: IncrementalDecoder, stops: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._matcher = StopStringMatcher(stops)
        self._decoded_len = 0  # characters decoded, held-back text included
        self._emitted_len = 0  # characters released (the text before a stop string, at most)
        self._text: list[str] = []  # released, not taken yet
        self._pending: deque[TokenLogprob] = deque()  # logprobs of tokens whose text is not all released
        self._logprobs: list[TokenLogprob] = []  # released, not taken yet

    @classmethod
    def without_text(cls) -> OutputText:
        """Tokens only: no text, no stop strings, every logprob ready at once (offset 0)."""
        return cls(_NO_TEXT)

    @property
    def stopped(self) -> bool:
        """A stop string matched: the text ends before it and the request must stop."""
        return self._matcher.matched is not None

    @property
    def matched(self) -> str | None:
        return self._matcher.matched

    def add(
        self, token_id: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None
    ) -> None:
        """The request's next token, with its logprob when the request asked for logprobs."""
        offset = self._decoded_len
        piece = self._decoder.step(token_id)
        self._decoded_len += len(piece)
        if logprob is not None:
            self._pending.append(TokenLogprob(token_id, logprob, top_logprobs or [], text_offset=offset))
        self._release(self._matcher.feed(piece))

    def close(self) -> bool:
        """No more tokens will come: release the held-back text, cut at a stop string that completed
        while a longer candidate was pending. Returns whether a stop string cut the text."""
        self._release(self._matcher.flush())
        return self.stopped

    def take(self) -> tuple[str, list[TokenLogprob]]:
        """The text and the logprobs released since the last take."""
        text, logprobs = "".join(self._text), self._logprobs
        self._text, self._logprobs = [], []
        return text, logprobs

    def _release(self, text: str) -> None:
        if text:
            self._text.append(text)
            self._emitted_len += len(text)
        pending = self._pending
        if not pending:
            return
        if self.stopped or self._matcher.held:
            # Offsets never decrease, so the tokens that start before the released end are a prefix.
            while pending and pending[0].text_offset < self._emitted_len:
                self._logprobs.append(pending.popleft())
            if self.stopped:
                pending.clear()
        else:
            self._logprobs.extend(pending)
            pending.clear()
