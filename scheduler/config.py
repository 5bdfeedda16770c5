"""The scheduler's knobs (ORCA's max_bs, the per-step token budget, the batching and KV policies) and
their command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Literal

from engine.cli_args import FlagGroup, auto_on_off, flag
from scheduler.speculation import SPECULATIVE_METHODS, SpeculativeMethod

Scheduling = Literal["iteration", "request"]
KVPolicyName = Literal["lazy", "reserve"]


@dataclass(frozen=True)
class SchedulerConfig(FlagGroup):
    FLAG_GROUP: ClassVar[str] = "scheduler"

    # ORCA's max_bs: the most requests in one iteration (and in one batch under `request`).
    max_num_seqs: int = flag(64, "most requests per iteration (ORCA's max_bs)")
    # Tokens (prompt + decode) run in one iteration. 2048 is the paper's maximum sequence length, so
    # with chunking off any of its prompts fits in one iteration; with chunking on it bounds a step's
    # cost so a long prompt cannot stall running decodes for more than one 2048-token step (vLLM's
    # long-standing default for the same reason).
    max_num_batched_tokens: int = flag(2048, "token budget per iteration")
    # Split prompts that do not fit the remaining token budget across iterations (Sarathi-Serve).
    chunked_prefill: bool = flag(
        True, "run each prompt in one iteration", name="--no-chunked-prefill", action="store_false"
    )
    # "iteration": ORCA; "request": the Triton-style baseline (run a batch until all of it is done).
    scheduling: Scheduling = flag("iteration", choices=("iteration", "request"), type=str)
    # "lazy": blocks are taken as tokens need them, preempt (recompute) when none is free (vLLM);
    # "reserve": ORCA's rule, reserve prompt + max_tokens at admission and never preempt.
    kv_policy: KVPolicyName = flag("lazy", choices=("lazy", "reserve"), type=str)
    # Automatic prefix caching (vLLM's, on by default there too): full KV blocks stay cached under a
    # hash of their tokens after their request ends, and a request whose prompt starts with cached
    # blocks starts after them (a chat's next turn, a shared system prompt, the n choices of a prompt).
    enable_prefix_caching: bool = flag(
        True,
        "reuse the KV blocks of prompts seen before (a chat's history, a shared system prompt, the n "
        "choices of a prompt); on by default",
        action=argparse.BooleanOptionalAction,
    )
    # A parallel engine whose worker died is restarted (its running requests fail, waiting ones are
    # served after); past this many restarts within the window the loop gives up (/health 503).
    max_worker_restarts: int = flag(
        3,
        "restarts of dead tensor/pipeline workers allowed within --worker-restart-window; past it the "
        "server gives up (0: never restart)",
    )
    worker_restart_window_s: float = flag(600.0, name="--worker-restart-window", metavar="SECONDS")
    # Speculative decoding (scheduler/speculation.py, docs/architecture.md "Speculative decoding"):
    # decoding requests propose tokens that one forward pass verifies, losslessly. auto: the draft
    # model where the engine has one (--draft-model), else n-gram prompt lookup.
    speculative: SpeculativeMethod = flag(
        "auto",
        "speculative decoding: ngram (proposals from the request's own prompt and output), draft (the "
        "engine's --draft-model), off; auto: draft with a draft model, else ngram",
        choices=SPECULATIVE_METHODS,
        type=str,
    )
    num_speculative_tokens: int = flag(8, "most tokens a request proposes in one step")
    # Past this many decoding requests in a step, nobody proposes: decode is compute-bound there and
    # verifying costs what it saves (below it the cost model decides, request by request).
    speculative_max_batch: int = flag(8, "no speculation in steps that decode more requests than this")
    # What one more token adds to a decode step, as a fraction of a one-token step: the cost model's
    # price of a proposal token (scheduler/speculation.py). 0.07-0.2 for the default model on a 2-core
    # CPU, by context length and load (docs/architecture.md, "Speculative decoding").
    speculative_token_cost: float = flag(
        0.12, "cost of one more token in a decode step, as a fraction of a one-token step"
    )

    # Overlapped scheduling (docs/architecture.md, "Overlapped scheduling"): the loop schedules the next
    # step, applies the last one's tokens and sends its deltas while the forward pass runs; a decoding
    # request's finish is seen one step late (its extra row is discarded). None (auto): always where
    # steps run on an accelerator; on the CPU, whose forward pass takes every core, only for steps of
    # more than one sequence (IterationLoop._schedules_ahead says why).
    overlap_schedule: bool | None = flag(
        None,
        "overlap the loop's CPU work (scheduling, applying tokens, detokenizing, stop checks, sending "
        "deltas) with the next forward pass: auto (on a GPU always, on a CPU past one stream), on or off",
        type=auto_on_off,
        metavar="auto|on|off",
    )

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
        if self.max_worker_restarts < 0 or self.worker_restart_window_s < 0:
            raise ValueError("max_worker_restarts and worker_restart_window_s must not be negative")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        if self.num_speculative_tokens < 1 or self.speculative_max_batch < 1:
            raise ValueError("num_speculative_tokens and speculative_max_batch must be >= 1")
        if not self.speculative_token_cost > 0:
            raise ValueError(f"speculative_token_cost must be positive, got {self.speculative_token_cost}")
