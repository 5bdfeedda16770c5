"""The contract between the scheduler and the engine. Pure Python: no torch here.

The scheduler builds a list of `ScheduledSequence` each step; an `Executor` runs them in one forward pass
and returns one `SampledToken` (or None) per entry, in the same order.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher

# Temperatures below this are greedy (vLLM uses the same bound): dividing logits by, say, 1e-8 overflows
# float32 to inf, and the softmax of that is NaN, which would be both the draw and the logprobs.
GREEDY_TEMPERATURE_EPS = 1e-5


# How an embedding request's final hidden states (after the final norm, before the LM head) become one
# vector: the last token's (decoder embedding models such as Qwen3-Embedding), the mean over every
# token, or the first token's (CLS).
Pooling = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[Pooling, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one sequence. Validated by the server."""

    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    logit_bias: dict[int, float] | None = None
    seed: int | None = None  # same seed, same tokens, whatever shares the batch
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top-k
    # None: none; k >= 0: each prompt token's logprob given the tokens before it, and the top-k there
    # (the model's raw distribution, as vLLM and OpenAI's echo report it; the first token has none).
    # The scheduler runs such a prompt whole through the model: a prefix cache must not skip it.
    prompt_logprobs: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Stop strings: the text ends before the earliest one, and the request stops in the step that
    # completes it (scheduler/stop.py). Matched on the text as decoded with skip_special_tokens.
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    # Structured output: this request's grammar state (one per choice, made by the server). The sampler
    # masks every token the grammar does not allow at this point (engine/token_mask.py).
    grammar: GrammarMatcher | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # What the sampler cannot apply; checked once, when a request's parameters are made (the server
        # has already answered 400 for these; this guards direct callers of the loop).
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must not be negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must not be negative, got {self.prompt_logprobs}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_outputs(self) -> bool:
        """Whether sampling reads the output tokens themselves (penalties, a grammar), not only how many
        there are (min_tokens, a seed's draw): such a row cannot run before its last token is known on
        the host (DeviceCarry)."""
        return self.needs_penalties or self.grammar is not None


# Overlapped scheduling (scheduler/overlap.py): the token id of a decode row scheduled while the step
# that samples its token is still running. The loop replaces it with that token before the row is
# submitted, or with CARRIED_PLACEHOLDER and names the row in a DeviceCarry: the executor puts the
# token in on the device. An executor never sees PENDING_TOKEN.
PENDING_TOKEN = -1
CARRIED_PLACEHOLDER = 0  # a valid id: what the host's copy of the inputs holds until then


@dataclass
class ScheduledSequence:
    """One request's share of a step: a whole prompt, a prompt chunk, or one decode token."""

    request_id: str
    token_ids: Sequence[int]  # the tokens to run this step
    start_position: int  # position of token_ids[0] == tokens of this request already in the KV cache
    block_table: Sequence[int]  # KV block ids; covers start_position + len(token_ids) tokens
    sample: bool  # False for a prompt chunk that is not the last: no token is sampled
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Prompt + generated tokens so far (read by penalties). A reference, not a copy.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Prompt logprobs: the first this many tokens of token_ids are also scored, i.e. the logits at
    # their positions give the logprob of the prompt token that follows each (positions
    # start_position .. start_position + num_prompt_scored - 1 score prompt tokens one further on).
    num_prompt_scored: int = 0
    # Speculative decoding (a decoding request: token_ids is its one uncomputed token). Proposed tokens
    # to verify after token_ids, at the positions that follow: the scheduler's own (n-gram proposals),
    # or none, and then the executor's draft model proposes `num_spec_tokens` itself. The block table
    # covers them and their K/V are written like a prompt chunk's; the result is a SampledToken with
    # every proposal the target accepted, then one token more. Only with sample=True.
    spec_token_ids: Sequence[int] = ()
    num_spec_tokens: int = 0
    # An embedding request's prompt chunk (then `sample` is False): the executor returns a PooledState,
    # this chunk's share of the pooling (every chunk returns one; the scheduler combines them).
    pooling: Pooling | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the request itself this step runs (proposals not counted)."""
        return len(self.token_ids)

    @property
    def spec_index(self) -> int:
        """Proposals before this entry's sampled position: 0 (engine.speculative.VerifyRow's differ)."""
        return 0

    @property
    def context_len(self) -> int:
        """Positions whose K/V this step writes, up to the last (proposals included: a rejected one's
        slot is rewritten by a later step)."""
        return self.start_position + len(self.token_ids) + self.num_spec_tokens


class SamplingRow(Protocol):
    """What the sampler and the grammar masker read of a batch entry (ScheduledSequence has it). Here,
    not in engine.sampler, so that engine.token_mask can name it without importing the sampler, which
    imports the masker's PendingMask: a circle even as type hints."""

    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    # Speculative decoding (engine/speculative.py): a verification's row j has spec_index j and outputs
    # that end with the j proposals before it; its row 0 has the proposals, along which the grammar
    # masker computes every row's mask. 0 and () for any other row.
    @property
    def spec_index(self) -> int: ...
    @property
    def spec_token_ids(self) -> Sequence[int]: ...


@dataclass
class PromptLogprobs:
    """What one step scored of a prompt (ScheduledSequence.num_prompt_scored tokens): entry j is the
    prompt token at position start_position + 1 + j, under the model's raw distribution."""

    logprobs: list[float]
    ranks: list[int]  # 1 = the likeliest token
    top_logprobs: list[list[tuple[int, float]]]  # best first, SamplingParams.prompt_logprobs each


@dataclass
class PooledState:
    """One step's share of an embedding request's pooling, over the final hidden states (float32) of
    the chunk it ran: their sum for "mean" (the scheduler adds the chunks' and divides by the prompt's
    length), the chunk's last token's for "last" (the prompt's last chunk decides), its first token's
    for "cls" (the chunk that starts at position 0 decides)."""

    values: list[float]  # [hidden]
    num_tokens: int  # tokens of the chunk


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token (log-softmax of the processed logits)
    top_logprobs: list[tuple[int, float]] | None = None  # best first, len == SamplingParams.logprobs
    prompt_logprobs: PromptLogprobs | None = None  # the last prompt chunk's, when it scored any
    # Speculative decoding: the tokens after this one that the step produced too (accepted proposals,
    # then the token after the last of them), each with its own logprobs; and how many proposals the
    # step verified. token_id is the first proposal when it was accepted, else the target's own token.
    following: list[SampledToken] = field(default_factory=list)
    num_verified: int = 0

    @property
    def tokens(self) -> list[SampledToken]:
        """This token and those that follow it, in order (one entry each, `following` left empty)."""
        if not self.following:
            return [self]
        first = SampledToken(self.token_id, self.logprob, self.top_logprobs, self.prompt_logprobs)
        return [first, *self.following]

    @property
    def num_accepted(self) -> int:
        """Proposals the target accepted: every token but the last when proposals were verified."""
        return len(self.following) if self.num_verified else 0


def is_carried(seq: ScheduledSequence) -> bool:
    """A decode row whose token the step before is sampling (PENDING_TOKEN)."""
    return len(seq.token_ids) == 1 and seq.token_ids[0] == PENDING_TOKEN


def carriable_on_device(batch: Sequence[ScheduledSequence], sampled: Container[str]) -> bool:
    """Whether `batch`'s carried rows can take their tokens on the device from a step that sampled for
    the requests `sampled`: each carried row's request is among them, and none reads its outputs (the
    last of which the host does not know yet). What Executor.carries answers for such a step."""
    return all(s.request_id in sampled and not s.sampling.reads_outputs for s in batch if is_carried(s))


@dataclass(frozen=True)
class DeviceCarry:
    """Overlapped scheduling on an accelerator: rows of a batch whose token is the one the step before
    sampled, still on the device (Executor.carries, submit(batch, carry))."""

    handle: Any  # the step before's, from submit(), not yet collected
    rows: list[int]  # indices into the batch of the carried rows (token id CARRIED_PLACEHOLDER)


# One result per batch entry: the sampled token, PromptLogprobs for a prompt chunk that scored tokens
# but samples nothing, PooledState for an embedding request's chunk, or None.
StepResult = SampledToken | PromptLogprobs | PooledState | None


class FatalRunnerError(RuntimeError):
    """The executor can run no more steps (a worker process died, a collective broke). Any other
    exception from a step fails only that step's requests. After this one the loop fails the requests
    whose KV cache went with it and calls `restart()` where the executor `can_restart` (within the
    restart budget); otherwise it fails every request and stops."""


class Executor(Protocol):
    """Everything the scheduler's loop (scheduler.loop.IterationLoop) uses of the engine: the sizes it
    schedules against, and steps. engine.executor.LocalExecutor and
    engine.distributed_executor.DistributedExecutor implement it; tests pass
    scheduler.fake_runner.FakeRunner.

    A step is `collect(submit(batch))`. `submit` starts it and returns a handle once the first pipeline
    stage has its share; `collect` waits for the step's tokens, one per entry of the batch in order
    (None where `sample` is False, PromptLogprobs where such an entry scored prompt tokens, PooledState
    for an entry with `pooling`). Up to `pipeline_depth` handles may be outstanding, collected in
    submission order. The batch is trusted: the loop validates every request at admission.
    """

    num_kv_blocks: int
    block_size: int  # tokens per KV block
    kv_cache_dtype: str  # what the KV cache stores (--kv-cache-dtype, resolved: "float16", "q8_0", ...)
    max_model_len: int  # prompt + output tokens the model takes
    vocab_size: int  # token ids are in [0, vocab_size)
    hidden_size: int  # the length of a PooledState's values (the model's hidden size)
    eos_token_ids: frozenset[int]
    pipeline_depth: int  # batches the loop may keep in flight (ORCA: one per pipeline stage)
    # Where a step computes ("cpu", "cuda", ...): the loop's --overlap-schedule auto overlaps its own
    # CPU work only with steps that leave the CPU's cores to it.
    device_type: str
    # Speculative decoding with a draft model: None without one, else what one draft forward costs as a
    # fraction of the target's (the scheduler's cost model prices proposals with it).
    draft_model_cost: float | None
    # The keys a query at position p may still read, p - kv_window + 1 .. p, in EVERY layer (a model
    # whose layers all have this sliding window, Mistral's way; None: some layer reads the whole
    # history). The scheduler gives back the KV blocks that fall behind it and puts block
    # `num_kv_blocks` (the cache's scratch block, which no request owns) in their table entries.
    kv_window: int | None

    @property
    def dead_reason(self) -> str | None:
        """Why no more steps can run (None while they can). Cheap: read by /health and the loop."""
        ...

    @property
    def can_restart(self) -> bool:
        """Whether restart() can bring this executor back once it is down (it owns its workers)."""
        ...

    def restart(self) -> None:
        """Bring a down executor back: fresh worker processes and process group, the same sizes, an
        empty KV cache (what the old one held is lost). Blocks for as long as that takes (processes
        start, weights load). Raises FatalRunnerError when it cannot."""
        ...

    def submit(self, batch: Sequence[ScheduledSequence]) -> Any:
        """Start a step; raises FatalRunnerError when the executor is down.

        Optional, for executors whose submit() returns before the step's tokens exist (a GPU's): a
        `carries(handle, batch) -> bool` method, true when `batch`'s carried rows can take their tokens
        from the not yet collected step `handle` on the device, and then `submit(batch, carry=
        DeviceCarry(handle, rows))`, which queues the step behind that one without waiting for it
        (engine.executor.LocalExecutor; the loop checks for the method)."""
        ...

    def collect(self, handle: Any) -> list[StepResult]:
        """Wait for a submitted step's tokens (in submission order)."""
        ...
