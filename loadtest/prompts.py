"""Prompts of exact token lengths cut from real text.

Token-id prompts are a window of the tokenized corpus: exactly `length` ids, sent as a list of ints
(the OpenAI completions API accepts that), so the server sees exactly that many tokens. Text prompts
(chat, or a server that refuses id lists) are decoded windows whose re-encoding is adjusted until it
has exactly `length` tokens, since decode-then-encode does not round-trip at token boundaries.
"""

from __future__ import annotations

import numpy as np

from loadtest.corpus import stdlib_text
from loadtest.tokenizer import PromptTokenizer

_MAX_ADJUST = 8  # re-encode rounds per window; a window that will not settle is replaced by another


# Tokenized corpora by (tokenizer, text): a sweep builds one workload per configuration, and
# re-tokenizing the same corpus with the same tokenizer for each would cost a second apiece.
_CORPUS_IDS: dict[tuple[str, str], list[int]] = {}


class PromptBuilder:
    def __init__(self, tokenizer: PromptTokenizer, corpus: str | None = None) -> None:
        self.tokenizer = tokenizer
        text = corpus if corpus is not None else stdlib_text()
        key = (tokenizer.description, text)
        if key not in _CORPUS_IDS:
            _CORPUS_IDS[key] = tokenizer.encode(text)
        self.corpus_ids: list[int] = _CORPUS_IDS[key]
        if len(self.corpus_ids) < 2:
            raise ValueError("the prompt corpus tokenizes to fewer than two tokens")

    def _window(self, start: int, length: int) -> list[int]:
        ids, n = self.corpus_ids, len(self.corpus_ids)
        if start + length <= n:
            return ids[start : start + length]
        # Lengths beyond the corpus wrap around; the corpus is long enough that this is rare.
        return [ids[(start + k) % n] for k in range(length)]

    def token_prompt(self, length: int, rng: np.random.Generator) -> list[int]:
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        return self._window(int(rng.integers(len(self.corpus_ids))), length)

    def count(self, text: str) -> int:
        """Tokens the server will see for a text prompt (special tokens included, as servers encode)."""
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def text_prompt(self, length: int, rng: np.random.Generator) -> str:
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        special = self.count("")  # e.g. a BOS the tokenizer adds to every text
        want = length - special
        if want < 1:
            raise ValueError(f"prompt length {length} leaves no room after {special} special tokens")
        for _ in range(64):
            start = int(rng.integers(len(self.corpus_ids)))
            take = want
            for _ in range(_MAX_ADJUST):
                text = self.tokenizer.decode(self._window(start, take))
                got = self.count(text)
                if got == length:
                    return text
                take = max(1, take + (length - got))
        raise RuntimeError(f"could not build a text prompt of exactly {length} tokens")
