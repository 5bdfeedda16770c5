"""The contract between the scheduler and the engine. Pure Python: no torch here.

The scheduler builds a list of `ScheduledSequence` each step; an `Executor` runs them in one forward pass
and returns one `SampledToken` (or None) per entry, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher

# Temperatures below this are greedy (vLLM uses the same bound): dividing logits by, say, 1e-8 overflows
# float32 to inf, and the softmax of that is NaN, which would be both the draw and the logprobs.
GREEDY_TEMPERATURE_EPS = 1e-5


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
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step has run."""
        return self.start_position + len(self.token_ids)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token (log-softmax of the processed logits)
    top_logprobs: list[tuple[int, float]] | None = None  # best first, len == SamplingParams.logprobs


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
    (None where `sample` is False). Up to `pipeline_depth` handles may be outstanding, collected in
    submission order. The batch is trusted: the loop validates every request at admission.
    """

    num_kv_blocks: int
    block_size: int  # tokens per KV block
    max_model_len: int  # prompt + output tokens the model takes
    vocab_size: int  # token ids are in [0, vocab_size)
    eos_token_ids: frozenset[int]
    pipeline_depth: int  # batches the loop may keep in flight (ORCA: one per pipeline stage)

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
        """Start a step; raises FatalRunnerError when the executor is down."""
        ...

    def collect(self, handle: Any) -> list[SampledToken | None]:
        """Wait for a submitted step's tokens (in submission order)."""
        ...
