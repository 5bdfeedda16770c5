"""The scheduler's knobs (ORCA's max_bs, the per-step token budget, the batching and KV policies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scheduling = Literal["iteration", "request"]
KVPolicyName = Literal["lazy", "reserve"]


@dataclass(frozen=True)
class SchedulerConfig:
    # ORCA's max_bs: the most requests in one iteration (and in one batch under `request`).
    max_num_seqs: int = 64
    # Tokens (prompt + decode) run in one iteration. 2048 is the paper's maximum sequence length, so
    # with chunking off any of its prompts fits in one iteration; with chunking on it bounds a step's
    # cost so a long prompt cannot stall running decodes for more than one 2048-token step (vLLM's
    # long-standing default for the same reason).
    max_num_batched_tokens: int = 2048
    # Split prompts that do not fit the remaining token budget across iterations (Sarathi-Serve).
    chunked_prefill: bool = True
    # "iteration": ORCA; "request": the Triton-style baseline (run a batch until all of it is done).
    scheduling: Scheduling = "iteration"
    # "lazy": blocks are taken as tokens need them, preempt (recompute) when none is free (vLLM);
    # "reserve": ORCA's rule, reserve prompt + max_tokens at admission and never preempt.
    kv_policy: KVPolicyName = "lazy"
    # Lowers the runner's maximum length when set; None uses the runner's.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # Every running request's decode token must fit one iteration, or decodes could starve.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if self.scheduling not in ("iteration", "request"):
            raise ValueError(f"scheduling must be 'iteration' or 'request', got {self.scheduling!r}")
        if self.kv_policy not in ("lazy", "reserve"):
            raise ValueError(f"kv_policy must be 'lazy' or 'reserve', got {self.kv_policy!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
