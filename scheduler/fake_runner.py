"""FakeRunner: a deterministic, torch-free ModelRunner for tests (scheduler, loop, server) and demos.

Its "model" maps a whole context to the next token with a hash, and it keeps the context in a
simulated paged KV cache that remembers which request wrote each slot. So a scheduling bug (a block
table that is too short or shared, a stale block read back, a wrong start position, a recompute that
skips tokens) raises or changes the tokens, as it would with a real model.
"""

from __future__ import annotations

import threading
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.contract import SampledToken, ScheduledSequence


def hash_next_token(context: Sequence[int], vocab_size: int = 49152, first_id: int = 3) -> int:
    """A token in [first_id, vocab_size) that depends on every token of the context (never EOS=2)."""
    return first_id + zlib.crc32(array("q", context).tobytes()) % (vocab_size - first_id)


@dataclass(frozen=True)
class StepRecord:
    """What one sequence of one step asked for (copied: the scheduler's lists change later)."""

    request_id: str
    start_position: int
    num_tokens: int
    sample: bool
    num_blocks: int


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        eos_token_ids: frozenset[int] = frozenset({2}),
        vocab_size: int = 49152,
        token_fn: Callable[[Sequence[int]], int] = hash_next_token,
        fail_when: Callable[[Sequence[ScheduledSequence]], bool] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.token_fn = token_fn
        self.fail_when = fail_when  # raise inside step() when it returns True
        self.gate = gate  # step() blocks until it is set (lets tests hold a step "in flight")
        self.step_started = threading.Event()  # set when a step begins (cleared by the test)
        # slot -> (request_id, token) of the last write
        self._slots: list[tuple[str, int] | None] = [None] * (num_kv_blocks * block_size)
        self.history: list[list[StepRecord]] = []

    @property
    def num_steps(self) -> int:
        return len(self.history)

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        self.step_started.set()
        if self.gate is not None:
            self.gate.wait()
        self.history.append(
            [
                StepRecord(s.request_id, s.start_position, s.num_tokens, s.sample, len(s.block_table))
                for s in batch
            ]
        )
        if self.fail_when is not None and self.fail_when(batch):
            raise RuntimeError("injected step failure")
        self._check_blocks(batch)
        bs = self.block_size
        for seq in batch:
            for i, tok in enumerate(seq.token_ids):
                pos = seq.start_position + i
                self._slots[seq.block_table[pos // bs] * bs + pos % bs] = (seq.request_id, tok)
        out: list[SampledToken | None] = []
        for seq in batch:
            if not seq.sample:
                out.append(None)
                continue
            context = [self._read(seq, pos) for pos in range(seq.context_len)]
            tok = self.token_fn(context)
            assert 0 <= tok < self.vocab_size
            logprob = -float(tok % 7) / 7.0  # deterministic, so tests can check it is carried through
            top = [(tok, logprob)] if seq.sampling.logprobs else []
            out.append(SampledToken(tok, logprob if seq.sampling.logprobs is not None else None, top))
        return out

    def _read(self, seq: ScheduledSequence, pos: int) -> int:
        bs = self.block_size
        entry = self._slots[seq.block_table[pos // bs] * bs + pos % bs]
        if entry is None or entry[0] != seq.request_id:
            raise AssertionError(f"{seq.request_id}: KV position {pos} holds {entry}, not its own token")
        return entry[1]

    def _check_blocks(self, batch: Sequence[ScheduledSequence]) -> None:
        seen: set[int] = set()
        for seq in batch:
            need = -(-seq.context_len // self.block_size)
            if len(seq.block_table) < need:
                raise AssertionError(
                    f"{seq.request_id}: {len(seq.block_table)} blocks for {seq.context_len} tokens"
                )
            if seq.context_len > self.max_model_len:
                raise AssertionError(f"{seq.request_id}: context {seq.context_len} > {self.max_model_len}")
            for b in seq.block_table:
                if not 0 <= b < self.num_kv_blocks or b in seen:
                    raise AssertionError(f"{seq.request_id}: block {b} out of range or shared")
                seen.add(b)
