"""FakeRunner: a deterministic, torch-free executor (engine.contract.Executor) for tests, demos and the
load tester's fake server.

Its "model" maps a whole context to the next token with a hash, and it keeps the context in a simulated
paged KV cache. Like a real model's K/V, what a slot holds stands for the whole context up to its
position: the token and a digest of every token before it. A read checks that digest against the
reading request's own tokens, so a request may read a block another request wrote (a shared prefix
from the prefix cache) only if it holds exactly what the reader would have computed itself. So a
scheduling bug (a block table that is too short, a block written by two sequences of one step, a stale
or evicted block read back, a wrong start position, a recompute that skips tokens) raises or changes the
tokens, as it would with a real model. With `pipeline_depth` > 1 it also checks ORCA's rules for
batches in flight (no request in two of them, each batch continuing where the last one ended or from
cached blocks, no block read that a batch in flight is still writing, collected in submission order).

Output is a function of the request's own context (and seed, when sampling with one) only, never of
what shares the batch, like a real model's greedy output; unseeded sampling gives the greedy tokens. A `script` replaces that with fixed tokens, so stop-string and
multi-byte tests know exactly what comes out.

Speculative decoding is simulated the same way: an entry's proposals are written to its slots like any
token (with the digest of the context they would make), the "target" token at each proposed position
is computed from the context read back from the cache, and the proposals are accepted while they match
it, then one more token follows. So a scheduler that rolls back wrongly (a computed count past the
accepted tokens, a rejected proposal's slot read as if it held an accepted token) raises or changes
the tokens. With `draft_fn` the runner also has a "draft model" (Executor.draft_model_cost is set)
that proposes tokens for entries that ask it to.

`FakeDetokenizer` gives its tokens text without a tokenizer (the loop's detokenizer in scheduler tests).
"""

from __future__ import annotations

import threading
import time
import zlib
from array import array
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, replace

from engine.contract import (
    FatalRunnerError,
    PooledState,
    PromptLogprobs,
    SampledToken,
    ScheduledSequence,
    StepResult,
)

# SmolLM2's ids 0..16 are special tokens: tokens from the plain range read as words once decoded.
FIRST_PLAIN_TOKEN = 17
PLAIN_TOKEN_SPAN = 20000


def hash_next_token(
    context: Sequence[int], first_id: int = FIRST_PLAIN_TOKEN, span: int = PLAIN_TOKEN_SPAN
) -> int:
    """A token in [first_id, first_id + span) that depends on every token of the context (never EOS)."""
    return first_id + zlib.crc32(array("q", context).tobytes()) % span


@dataclass(frozen=True)
class StepRecord:
    """What one sequence of one step asked for (copied: the scheduler's lists change later)."""

    request_id: str
    start_position: int
    num_tokens: int
    sample: bool
    num_blocks: int
    num_spec_tokens: int = 0


def mostly_right_draft(context: Sequence[int]) -> int:
    """A draft "model" for hash_next_token that guesses right three times in four, deterministically."""
    tok = hash_next_token(context)
    return tok if zlib.crc32(array("q", context).tobytes()) % 4 else tok + 1


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        eos_token_ids: frozenset[int] = frozenset({2}),
        vocab_size: int = 49152,
        pipeline_depth: int = 1,
        token_fn: Callable[[Sequence[int]], int] = hash_next_token,
        script: Sequence[int] | None = None,
        fail_when: Callable[[Sequence[ScheduledSequence]], bool] | None = None,
        fail_at_step: int | None = None,
        gate: threading.Event | None = None,
        step_delay_s: float = 0.0,
        per_token_delay_s: float = 0.0,
        simulate_kv: bool = True,
        can_restart: bool = False,
        draft_fn: Callable[[Sequence[int]], int] | None = None,
        hidden_size: int = 16,
        kv_window: int | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv_cache_dtype = "float32"  # nothing is stored; the engine's default type on a GPU
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size  # of the made-up hidden states embedding requests pool
        self.pipeline_depth = pipeline_depth
        # Not "cpu": a made-up step leaves the cores to the loop, so --overlap-schedule auto overlaps.
        self.device_type = "fake"
        self.token_fn = token_fn
        self.script = list(script) if script is not None else None
        self.fail_when = fail_when  # a step raises when it returns True
        self.fail_at_step = fail_at_step  # every step from this one (1-based) raises
        # step() blocks until the gate is set: tests hold a step "in flight" without sleeping on a clock.
        self.gate = gate if gate is not None else threading.Event()
        if gate is None:
            self.gate.set()
        self.step_started = threading.Event()  # set when a step begins (cleared by the test)
        self.step_delay_s = step_delay_s  # a step's simulated time, plus per_token_delay_s per token
        self.per_token_delay_s = per_token_delay_s
        # False: read the context from the batch's prompt/output ids instead of the simulated cache, which
        # costs O(context) Python per sampled token (the load tester's fake server runs long contexts).
        self.simulate_kv = simulate_kv
        self.dead_reason: str | None = None
        # kill() takes it down like a dead worker (FatalRunnerError); restart() brings it back with an
        # empty simulated cache, so a request that reads its old KV after a restart raises.
        self.can_restart = can_restart
        self.num_restarts = 0
        self.fail_restart = False  # restart() raises instead
        # The "draft model": the token it proposes after a context (None: no draft model).
        self.draft_fn = draft_fn
        self.draft_model_cost: float | None = 0.05 if draft_fn is not None else None
        # A model whose every layer has this sliding window (Executor.kv_window): a step reads back
        # only the keys its queries' windows reach, and the scheduler may give back blocks behind them
        # (their table entries name block num_kv_blocks). The tokens stay a function of the whole
        # context, the part behind the window taken from the request's ids, so outputs do not change.
        self.kv_window = kv_window
        # slot -> (token, digest of the context through it) of the last write
        self._slots: list[tuple[int, int] | None] = [None] * (
            num_kv_blocks * block_size if simulate_kv else 0
        )
        self.history: list[list[StepRecord]] = []
        self.max_batch_seen = 0
        # Pipelined submission (pipeline_depth > 1): batches submitted and not collected yet.
        self.in_flight: list[list[ScheduledSequence]] = []
        self.max_in_flight = 0
        self._computed: dict[str, int] = {}  # tokens each request has had submitted

    @property
    def num_steps(self) -> int:
        return len(self.history)

    # ---- engine.contract.Executor ---------------------------------------------------------------------

    def kill(self, reason: str = "worker fake-rank1 exited with code -9") -> None:
        """Go down as a parallel engine does when a worker dies: every later step raises."""
        self.dead_reason = reason

    def restart(self) -> None:
        if not self.can_restart or self.fail_restart:
            raise FatalRunnerError(f"cannot restart: {self.dead_reason}")
        self.num_restarts += 1
        self.dead_reason = None
        self.in_flight.clear()
        self._computed.clear()
        if self.simulate_kv:
            self._slots = [None] * len(self._slots)

    def _check_up(self) -> None:
        if self.dead_reason is not None:
            raise FatalRunnerError(f"the engine is down: {self.dead_reason}")

    def submit(self, batch: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
        self._check_up()
        busy = {s.request_id for b in self.in_flight for s in b}
        bs = self.block_size
        writing = {
            s.block_table[pos // bs]
            for b in self.in_flight
            for s in b
            for pos in range(s.start_position, s.context_len)
        }
        for seq in batch:
            assert seq.request_id not in busy, f"{seq.request_id} in two in-flight batches"
            # Each batch continues where the last ended (its accepted tokens), except a preempted
            # request (from 0) and one starting from cached blocks (at a block boundary).
            start = seq.start_position
            assert start == self._computed.get(seq.request_id, 0) or start % bs == 0, seq.request_id
            # Blocks it reads without writing hold K/V that exist: no batch in flight is writing them.
            assert not set(seq.block_table[self._first_read(seq) // bs : start // bs]) & writing, (
                f"{seq.request_id} reads a block in flight"
            )
            assert not seq.num_spec_tokens or (seq.sample and seq.num_tokens == 1), seq.request_id
            assert len(seq.spec_token_ids) in (0, seq.num_spec_tokens), seq.request_id
            assert seq.spec_token_ids or self.draft_fn is not None or not seq.num_spec_tokens, (
                f"{seq.request_id} asks for drafts and there is no draft model"
            )
            self._computed[seq.request_id] = start + seq.num_tokens
        self.in_flight.append(list(batch))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        assert len(self.in_flight) <= self.pipeline_depth, "more batches in flight than pipeline_depth"
        return self.in_flight[-1]

    def collect(self, handle: list[ScheduledSequence]) -> list[StepResult]:
        self._check_up()
        assert self.in_flight and handle is self.in_flight[0], "collected out of submission order"
        self.in_flight.pop(0)
        return self.step(handle)

    # ---- one step -------------------------------------------------------------------------------------

    def step(self, batch: Sequence[ScheduledSequence]) -> list[StepResult]:
        self.step_started.set()
        self.gate.wait()
        batch = [self._with_drafts(seq) for seq in batch]
        delay = self.step_delay_s + self.per_token_delay_s * sum(
            s.num_tokens + s.num_spec_tokens for s in batch
        )
        if delay:
            time.sleep(delay)
        self.history.append(
            [
                StepRecord(
                    s.request_id,
                    s.start_position,
                    s.num_tokens,
                    s.sample,
                    len(s.block_table),
                    s.num_spec_tokens,
                )
                for s in batch
            ]
        )
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        if (self.fail_when is not None and self.fail_when(batch)) or (
            self.fail_at_step is not None and self.num_steps >= self.fail_at_step
        ):
            raise RuntimeError("injected step failure")
        if not self.simulate_kv:
            return self._results(batch, [None] * len(batch))
        self._check_blocks(batch)
        bs = self.block_size
        digests = [self._digests(seq) for seq in batch]
        # Every write of the step lands before any read, as in a real forward pass (per layer).
        for seq, digest in zip(batch, digests, strict=True):
            for i, tok in enumerate([*seq.token_ids, *seq.spec_token_ids]):
                pos = seq.start_position + i
                self._slots[seq.block_table[pos // bs] * bs + pos % bs] = (tok, digest[pos])
        return self._results(batch, digests)

    def _with_drafts(self, seq: ScheduledSequence) -> ScheduledSequence:
        """The entry with its proposals, made by the draft model when it asked for them: each the
        draft's token after the context with the proposals before it."""
        if not seq.num_spec_tokens or seq.spec_token_ids:
            return seq
        assert self.draft_fn is not None
        context = [*seq.prompt_token_ids, *seq.output_token_ids]
        drafts: list[int] = []
        for _ in range(seq.num_spec_tokens):
            drafts.append(self.draft_fn([*context, *drafts]))
        return replace(seq, spec_token_ids=drafts)

    def _results(
        self, batch: Sequence[ScheduledSequence], digests: Sequence[list[int] | None]
    ) -> list[StepResult]:
        out: list[StepResult] = []
        for seq, digest in zip(batch, digests, strict=True):
            if seq.pooling is not None:
                out.append(self._pool(seq, digest))
                continue
            scored = self._score(seq) if seq.num_prompt_scored else None
            if seq.sample:
                tok = self._verify(seq, digest) if seq.num_spec_tokens else self._sample(seq, digest)
                tok.prompt_logprobs = scored
                out.append(tok)
            else:
                out.append(scored)
        return out

    def _verify(self, seq: ScheduledSequence, digest: list[int] | None) -> SampledToken:
        """The target's token at each proposed position, the proposals accepted while they match it,
        and one token more (as engine/speculative.py does for greedy rows)."""
        drafts = list(seq.spec_token_ids)
        tokens: list[SampledToken] = []
        for j in range(len(drafts) + 1):
            tok = self._sample(seq, digest, j)
            tokens.append(tok)
            if j == len(drafts) or tok.token_id != drafts[j]:
                break
        # The next batch continues after the accepted ones (submit checks it).
        self._computed[seq.request_id] = seq.start_position + seq.num_tokens + len(tokens) - 1
        first = tokens[0]
        first.following = tokens[1:]
        first.num_verified = len(drafts)
        return first

    def _pool(self, seq: ScheduledSequence, digest: list[int] | None) -> PooledState:
        """The chunk's share of its pooling over made-up hidden states: each position's is a function of
        the context through it, read back from the simulated cache (so a chunk that attends to the
        wrong K/V pools something else, as a real model's would)."""
        end = seq.start_position + seq.num_tokens
        if digest is not None:
            context = self._context(seq, end, digest)
        else:
            context = list(seq.prompt_token_ids[:end])
        states = [self.hidden_state(context[: pos + 1]) for pos in range(seq.start_position, end)]
        if seq.pooling == "mean":
            values = [sum(column) for column in zip(*states, strict=True)]
        else:
            values = states[-1] if seq.pooling == "last" else states[0]
        return PooledState(values, seq.num_tokens)

    def hidden_state(self, context: Sequence[int]) -> list[float]:
        """The made-up final hidden state at the end of `context`: hidden_size values in [-1, 1]."""
        crc = zlib.crc32(array("q", context).tobytes())
        return [
            (zlib.crc32(j.to_bytes(2, "little"), crc) % 2001 - 1000) / 1000.0 for j in range(self.hidden_size)
        ]

    @staticmethod
    def _score(seq: ScheduledSequence) -> PromptLogprobs:
        """Made-up but well-formed prompt logprobs: each scored token at rank 1, then alternatives."""
        first = seq.start_position + 1
        targets = seq.prompt_token_ids[first : first + seq.num_prompt_scored]
        k = seq.sampling.prompt_logprobs or 0
        logprobs = [-float(t % 5) / 5.0 for t in targets]
        return PromptLogprobs(
            logprobs=logprobs,
            ranks=[1] * len(targets),
            top_logprobs=[
                [(t, lp), *((t + i, lp - i) for i in range(1, k))][:k]
                for t, lp in zip(targets, logprobs, strict=True)
            ],
        )

    def _sample(self, seq: ScheduledSequence, digest: list[int] | None, spec_index: int = 0) -> SampledToken:
        """The token after the entry's own tokens and its first `spec_index` proposals."""
        params = seq.sampling
        end = seq.start_position + seq.num_tokens + spec_index
        if digest is not None:
            context = self._context(seq, end, digest)
        else:
            context = [*seq.prompt_token_ids, *seq.output_token_ids, *seq.spec_token_ids[:spec_index]]
        if self.script is not None:
            tok = self.script[(len(seq.output_token_ids) + spec_index) % len(self.script)]
        elif params.seed is not None and not params.greedy:
            tok = self.token_fn([params.seed, *context])
        else:  # greedy, and unseeded sampling too: the same request always gives the same tokens
            tok = self.token_fn(context)
        assert 0 <= tok < self.vocab_size
        if params.logprobs is None:
            return SampledToken(tok)
        # A made-up but well-formed distribution, deterministic so tests can check it is carried
        # through: the chosen token is the likeliest, then `logprobs` alternatives.
        logprob = -float(tok % 7) / 7.0
        top = [(tok, logprob)] + [(tok + i, logprob - i) for i in range(1, params.logprobs)]
        return SampledToken(tok, logprob, top[: params.logprobs])

    @staticmethod
    def _digests(seq: ScheduledSequence) -> list[int]:
        """Digest of the request's context through each position of this step's context (proposals
        included: the digest of the context a proposal makes, which a rejected one's later rewrite
        replaces)."""
        own = seq.start_position + seq.num_tokens
        context = [*seq.prompt_token_ids, *seq.output_token_ids][:own]
        if len(context) < own or list(seq.token_ids) != context[seq.start_position :]:
            raise AssertionError(f"{seq.request_id}: the step's tokens are not its prompt + outputs")
        context += seq.spec_token_ids
        digests = []
        crc = 0
        for tok in context:
            crc = zlib.crc32(tok.to_bytes(8, "little", signed=True), crc)
            digests.append(crc)
        return digests

    def _first_read(self, seq: ScheduledSequence) -> int:
        """The first position any query of the entry reads from the cache: 0, or its first query's
        window start."""
        if self.kv_window is None:
            return 0
        return max(0, seq.start_position - self.kv_window + 1)

    def _context(self, seq: ScheduledSequence, end: int, digest: list[int]) -> list[int]:
        """The entry's context through position end - 1: read back from the simulated cache where its
        queries' windows reach, from its ids behind that."""
        lo = min(self._first_read(seq), end)
        behind = [*seq.prompt_token_ids, *seq.output_token_ids][:lo]
        return behind + [self._read(seq, pos, digest[pos]) for pos in range(lo, end)]

    def _read(self, seq: ScheduledSequence, pos: int, digest: int) -> int:
        bs = self.block_size
        entry = self._slots[seq.block_table[pos // bs] * bs + pos % bs]
        if entry is None or entry[1] != digest:
            raise AssertionError(f"{seq.request_id}: KV position {pos} holds {entry}, not its context's")
        return entry[0]

    def _check_blocks(self, batch: Sequence[ScheduledSequence]) -> None:
        bs = self.block_size
        for seq in batch:
            need = -(-seq.context_len // bs)
            if len(seq.block_table) < need:
                raise AssertionError(
                    f"{seq.request_id}: {len(seq.block_table)} blocks for {seq.context_len} tokens"
                )
            if seq.context_len > self.max_model_len:
                raise AssertionError(f"{seq.request_id}: context {seq.context_len} > {self.max_model_len}")
            first = self._first_read(seq) // bs
            behind, live = seq.block_table[:first], seq.block_table[first:]  # behind: maybe given back
            if len(set(live)) != len(live):
                raise AssertionError(f"{seq.request_id}: a block twice in one table")
            n = self.num_kv_blocks  # block n: the scratch block a given-back entry names
            if not (all(0 <= b < n for b in live) and all(0 <= b <= n for b in behind)):
                raise AssertionError(f"{seq.request_id}: a block out of range in {list(seq.block_table)}")
        # A block a sequence writes is in no other sequence's table this step: shared blocks are only
        # read (a cached prefix), never written under another reader.
        written: dict[int, str] = {}
        for seq in batch:
            for pos in range(seq.start_position, seq.context_len):
                block = seq.block_table[pos // bs]
                if written.setdefault(block, seq.request_id) != seq.request_id:
                    raise AssertionError(f"{seq.request_id}: block {block} is written by two sequences")
        for seq in batch:
            for b in seq.block_table[self._first_read(seq) // bs :]:
                if written.get(b, seq.request_id) != seq.request_id:
                    raise AssertionError(f"{seq.request_id}: reads block {b}, which another sequence writes")


class FakeDetokenizer:
    """A tokenizer-free stand-in for the server's (scheduler.output_text.Detokenizer), so the loop's text
    and stop strings are tested in milliseconds: token id -> `pieces[id]`, else ` t<id>`; ids in
    `special` read `<s<id>>`, or nothing with skip_special_tokens. A piece of "" stands for a token that
    ends in the middle of a character (DecodeStream returns nothing until the character is complete)."""

    def __init__(self, pieces: Mapping[int, str] | None = None, special: Set[int] = frozenset({2})) -> None:
        self.pieces = dict(pieces or {})
        self.special = frozenset(special)

    def text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        if token_id in self.special:
            return "" if skip_special_tokens else f"<s{token_id}>"
        return self.pieces.get(token_id, f" t{token_id}")

    def decode_stream(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> _FakeDecodeStream:
        return _FakeDecodeStream(self, skip_special_tokens)


class _FakeDecodeStream:
    def __init__(self, detokenizer: FakeDetokenizer, skip_special_tokens: bool) -> None:
        self._detokenizer = detokenizer
        self._skip = skip_special_tokens

    def step(self, token_id: int) -> str:
        return self._detokenizer.text(token_id, self._skip)
