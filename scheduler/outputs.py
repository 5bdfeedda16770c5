"""What the iteration loop hands back to its callers (the server): one delta per step per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # abort(): client gone, timeout, shutdown
    ERROR = "error"  # the step failed; `error` says why


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first
    rank: int | None = None  # 1 = the likeliest (prompt logprobs report it, as vLLM does)
    # An output token's: where its text starts in the request's output text (OpenAI's text_offset).
    text_offset: int = 0


@dataclass
class RequestDelta:
    """New output of one request since its previous delta."""

    request_id: str
    token_ids: list[int]  # new tokens (several if the consumer lagged behind the loop)
    # When SamplingParams.logprobs is set: one per token whose text is in the emitted text, in order.
    # Not one per new token: a token whose text is held back (it may start a stop string) comes with
    # the delta that emits its text, and tokens that make up a stop string never come.
    logprobs: list[TokenLogprob] | None
    # New text, decoded by the loop's detokenizer ("" without one): never a stop string nor a part of
    # one that may still complete; the concatenation of a request's deltas is its whole text.
    text: str = ""
    finish_reason: FinishReason | None = None  # set on the last delta only
    # On the last delta: the stop string that ended the request (vLLM's stop_reason; None for EOS, a
    # stop token or a limit). Anthropic's API reports it as stop_sequence.
    stop_string: str | None = None
    error: str | None = None  # with FinishReason.ERROR
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, this delta included
    # Prompt tokens that came from the prefix cache instead of being computed (usage's cached_tokens).
    num_cached_tokens: int = 0
    # On the request's first delta only (None after): seconds from arrival to its first scheduling,
    # vLLM's request_queue_time. None also when the request ended before it was ever scheduled.
    queue_time_s: float | None = None
    # On the first delta only, with SamplingParams.prompt_logprobs: one per prompt token, None for
    # the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On an embedding request's last delta (IterationLoop.embed), when it finished with STOP: the pooled
    # final hidden states of its prompt, float32 values, not normalised.
    embedding: list[float] | None = None


@dataclass
class PrefixCacheStats:
    """Running totals of the prefix cache, in tokens like vLLM's counters, and its size now."""

    queries: int = 0  # tokens of requests looked up at their first admission (vLLM's queries)
    hits: int = 0  # of those, tokens taken from the cache instead of computed (vLLM's hits)
    computed_prompt_tokens: int = 0  # prompt tokens (and recomputed outputs) actually run
    cached_blocks: int = 0  # blocks holding a reusable prefix now, held or evictable
    evictions: int = 0  # cached blocks whose memory was taken for new tokens


@dataclass
class SpecStats:
    """Running totals of speculative decoding (vLLM's spec_decode counters)."""

    num_verifications: int = 0  # entries whose proposals a step verified (vLLM's num_drafts)
    proposed_tokens: int = 0  # vLLM's num_draft_tokens
    accepted_tokens: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_verifications += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    kv_blocks_used: int  # held by requests; cached blocks nobody holds count as free
    kv_blocks_total: int
    num_preemptions: int
    num_steps: int
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_restarts: int = 0  # of the executor (its workers died), by the loop
    speculation: SpecStats = field(default_factory=SpecStats)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class StepReport:
    """What one iteration did, for the server's metrics (handed to IterationLoop step listeners)."""

    num_seqs: int
    num_tokens: int
    num_prompt_tokens: int  # prompt tokens, and outputs recomputed after a preemption
    num_decode_tokens: int  # decoding requests (one token of their own each; proposals not counted)
    duration_s: float  # time in runner.step
    num_preempted: int = 0
    num_finished: int = 0
    failed: bool = False  # the step raised; its requests got an error delta
    # Per-request detail, for the live iteration view: what the loop already holds, as ids and ints
    # (no per-request objects). The batch in order: request_ids[i] ran request_num_tokens[i] tokens
    # from position request_start_positions[i] (0: admitted this step, or recomputing after a
    # preemption); request_is_decode[i] says it ran one output token rather than a prompt chunk.
    step: int = 0  # the loop's step counter, 1 for the first step
    request_ids: list[str] = field(default_factory=list)
    request_num_tokens: list[int] = field(default_factory=list)
    request_start_positions: list[int] = field(default_factory=list)
    request_is_decode: list[bool] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Ended by this step (or while scheduling it): stop, length, error. Aborts between steps are not here.
    finished_ids: list[str] = field(default_factory=list)
    num_waiting: int = 0  # after the step
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Speculative decoding: proposed tokens the step verified and how many the target accepted, in all
    # and per request (request_num_proposed[i] of request_ids[i]'s, 0 where it proposed none). The
    # generated tokens are num_decode_tokens + num_spec_accepted.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    request_num_proposed: list[int] = field(default_factory=list)
    request_num_accepted: list[int] = field(default_factory=list)
