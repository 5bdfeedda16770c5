"""One request's state as the scheduler sees it: status, tokens, text, KV blocks, timestamps."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.contract import PooledState, Pooling, PromptLogprobs, SamplingParams
from scheduler.block_allocator import BlockHash
from scheduler.output_text import OutputText
from scheduler.outputs import FinishReason, TokenLogprob
from scheduler.speculation import NgramIndex, SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from prompt + outputs so far
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)  # identity semantics: requests live in sets and deques
class Request:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # The outputs as text (cut at a stop string) and their logprobs, until the loop hands them out.
    # Made at admission from the loop's detokenizer (scheduler.output_text.start_output).
    output_text: OutputText = field(default_factory=OutputText.without_text)
    # Prompt tokens 1.. scored so far, only when sampling.prompt_logprobs is set (token 0 has none).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Tokens of prompt + outputs whose K/V are in the cache. Reset to 0 by preemption (recompute).
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix caching: names of the request's full blocks of prompt + outputs (computed on demand, kept
    # across preemptions: they depend only on the tokens), how many of `block_ids` have been offered to
    # the cache, and the prompt tokens taken from the cache instead of computed (OpenAI's
    # usage.prompt_tokens_details.cached_tokens; fixed once the request is first preempted).
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_offered_blocks: int = 0
    # Blocks at the front of `block_ids` given back because every layer's sliding window has passed
    # them (scheduler.policy.KVPolicy.release_behind_window); their entries name the scratch block.
    num_released_blocks: int = 0
    num_cached_tokens: int = 0
    # Output tokens already handed to the client, so a recomputed request never re-emits them.
    num_emitted_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: how its last verification went, and its n-gram index for prompt lookup
    # (made on its first lookup; it only grows, like prompt + outputs).
    spec: SpecState = field(default_factory=SpecState)
    ngram: NgramIndex | None = field(default=None, repr=False)
    # An embedding request (prefill only: it runs its prompt, pools the final hidden states and
    # finishes, sampling nothing): how it pools, and what its chunks pooled so far (PooledState).
    pooling: Pooling | None = None
    pooled: list[float] | None = None
    error: str | None = None
    # Timestamps (time.monotonic()) for metrics: TTFT = first_token - arrival, queueing = first
    # scheduled - arrival, end-to-end = finish - arrival.
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to run before the next sample: the whole prompt (+ outputs, after preemption) or 1."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def prompt_tokens_to_score(self, start: int, end: int) -> int:
        """How many leading positions of the chunk [start, end) to score for prompt logprobs: each
        position before the prompt's last predicts a prompt token. None once all are scored (a
        recompute after a preemption does not score them again)."""
        if self.sampling.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1:
            return 0
        return max(0, min(end, self.num_prompt_tokens - 1) - start)

    def add_prompt_logprobs(self, start: int, scored: PromptLogprobs) -> None:
        """Keep what a step scored from position `start` on (prompt token start + 1 first)."""
        have = len(self.prompt_logprobs)
        for j, (lp, top) in enumerate(zip(scored.logprobs, scored.top_logprobs, strict=True)):
            index = start + 1 + j  # the prompt token scored
            if index == have + 1:
                self.prompt_logprobs.append(
                    TokenLogprob(self.prompt_token_ids[index], lp, top, rank=scored.ranks[j])
                )
                have += 1

    def add_pooled(self, start: int, pooled: PooledState) -> None:
        """Combine what a step pooled of the chunk from position `start` with the chunks before it. A
        chunk at 0 starts over (a recompute after a preemption runs the prompt again)."""
        if self.pooling == "mean":
            if start == 0 or self.pooled is None:
                self.pooled = list(pooled.values)
            else:
                self.pooled = [a + b for a, b in zip(self.pooled, pooled.values, strict=True)]
        elif self.pooling == "last" or start == 0:  # cls: the chunk that holds the first token
            self.pooled = list(pooled.values)

    @property
    def embedding(self) -> list[float] | None:
        """The pooled vector (not normalised) once the whole prompt has run; None before."""
        if self.pooled is None or self.num_computed_tokens < self.num_prompt_tokens:
            return None
        if self.pooling == "mean":
            return [v / self.num_prompt_tokens for v in self.pooled]
        return self.pooled

    def token_slice(self, start: int, end: int) -> Sequence[int]:
        """Tokens [start, end) of prompt + outputs, without copying the prompt when it is enough."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - n_prompt]]
