"""The scheduler's knobs (ORCA's max_bs, the per-step token budget, the batching and KV policies) and
their command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
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
    # Automatic prefix caching (vLLM's, on by default there too): full KV blocks stay cached under a
    # hash of their tokens after their request ends, and a request whose prompt starts with cached
    # blocks starts after them (a chat's next turn, a shared system prompt, the n choices of a prompt).
    enable_prefix_caching: bool = True
    # A parallel engine whose worker died is restarted (its running requests fail, waiting ones are
    # served after); past this many restarts within the window the loop gives up (/health 503).
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 600.0

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

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The scheduler's flags (the server and loadtest.inprocess take the same ones)."""
        d = SchedulerConfig
        g = p.add_argument_group("scheduler")
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=d.max_num_seqs,
            help="most requests per iteration (ORCA's max_bs)",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=d.max_num_batched_tokens,
            help="token budget per iteration",
        )
        g.add_argument(
            "--no-chunked-prefill",
            dest="chunked_prefill",
            action="store_false",
            default=d.chunked_prefill,
            help="run each prompt in one iteration",
        )
        g.add_argument("--scheduling", default=d.scheduling, choices=["iteration", "request"])
        g.add_argument("--kv-policy", default=d.kv_policy, choices=["lazy", "reserve"])
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
            help="reuse the KV blocks of prompts seen before (a chat's history, a shared system prompt, "
            "the n choices of a prompt); on by default",
        )
        g.add_argument(
            "--max-worker-restarts",
            type=int,
            default=d.max_worker_restarts,
            help="restarts of dead tensor/pipeline workers allowed within --worker-restart-window; "
            "past it the server gives up (0: never restart)",
        )
        g.add_argument(
            "--worker-restart-window",
            dest="worker_restart_window_s",
            metavar="SECONDS",
            type=float,
            default=d.worker_restart_window_s,
        )

    @classmethod
    def from_cli_args(cls, a: argparse.Namespace) -> SchedulerConfig:
        """The config the flags of add_cli_args describe (flags a parser lacks keep their defaults)."""
        return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if hasattr(a, f.name)})
