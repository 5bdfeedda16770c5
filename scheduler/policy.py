"""The policies: when KV blocks are taken (lazy / reserve) and when requests join and leave a batch
(iteration / request). The scheduler (scheduler.core) asks them; they hold no request queues."""

from __future__ import annotations

from abc import ABC, abstractmethod

from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.request import Request

# --------------------------------------------------------------------------------------------------
# KV policies


class KVPolicy(ABC):
    """Decides how many KV blocks a request takes, and when."""

    # Whether running out of blocks preempts a running request (else it is a bug: the policy reserved).
    preempts: bool

    def __init__(self, allocator: BlockAllocator, max_model_len: int) -> None:
        self.allocator = allocator
        self.max_model_len = max_model_len

    @abstractmethod
    def admit(self, req: Request, num_new_tokens: int) -> bool:
        """Take the blocks a waiting request needs to join with num_new_tokens run at once.
        False, with nothing taken, if they are not free."""

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Take the blocks a running request needs to run num_new_tokens more. False if not free."""
        return self.allocator.ensure_capacity(req.block_ids, req.num_computed_tokens + num_new_tokens)

    def release(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids.clear()


class LazyKV(KVPolicy):
    """vLLM's paging: a block is taken when a token needs it; the scheduler preempts when none is."""

    preempts = True

    def admit(self, req: Request, num_new_tokens: int) -> bool:
        return self.grow(req, num_new_tokens)


class ReserveKV(KVPolicy):
    """ORCA's rule: reserve prompt + max_tokens at admission, so a running request never runs out."""

    preempts = False

    def admit(self, req: Request, num_new_tokens: int) -> bool:
        # Outputs already made count against max_tokens (relevant only if a request was preempted
        # under another policy; reserve itself never preempts).
        remaining_outputs = req.sampling.max_tokens - req.num_output_tokens
        total = min(req.num_tokens + remaining_outputs, self.max_model_len)
        return self.allocator.ensure_capacity(req.block_ids, total)


def make_kv_policy(config: SchedulerConfig, allocator: BlockAllocator, max_model_len: int) -> KVPolicy:
    cls = {"lazy": LazyKV, "reserve": ReserveKV}[config.kv_policy]
    return cls(allocator, max_model_len)


# --------------------------------------------------------------------------------------------------
# Batching policies


class BatchingPolicy(ABC):
    """Decides when waiting requests may join, and when a finished request is handed back."""

    # Admission counts against this step's token budget (a request joins when its tokens run), or
    # requests join as a batch and their prompts are then run across steps under the budget.
    admission_uses_token_budget: bool
    # Whether unfinished requests' new tokens are handed out after every step.
    streams: bool

    @abstractmethod
    def may_admit(self) -> bool:
        """Whether this step may take waiting requests."""

    @abstractmethod
    def on_admitted(self, req: Request) -> None:
        """The request joined the running set."""

    @abstractmethod
    def on_left(self, req: Request, hold: bool) -> list[Request]:
        """The request finished (hold=True: normal end) or left the batch (preempted, aborted, failed).
        Returns the finished requests to hand back to their clients now."""


class IterationBatching(BatchingPolicy):
    """ORCA: admission at every iteration; a finished request returns at once."""

    admission_uses_token_budget = True
    streams = True

    def may_admit(self) -> bool:
        return True

    def on_admitted(self, req: Request) -> None:
        return None  # every request stands alone: there is no batch to track

    def on_left(self, req: Request, hold: bool) -> list[Request]:
        return [req] if req.is_finished else []


class RequestBatching(BatchingPolicy):
    """The Triton + FasterTransformer baseline: take up to max_bs requests, run them until every one
    has finished, admit nothing in between. Like FasterTransformer behind Triton, results come back
    only when the whole batch ends: an early finisher waits for the longest request, and nothing is
    streamed (that is the behaviour the paper measures against, its Figure 3)."""

    admission_uses_token_budget = False
    streams = False

    def __init__(self) -> None:
        self._members: set[Request] = set()  # admitted, not finished
        self._held: list[Request] = []  # finished, waiting for the rest of the batch

    def may_admit(self) -> bool:
        return not self._members

    def on_admitted(self, req: Request) -> None:
        self._members.add(req)

    def on_left(self, req: Request, hold: bool) -> list[Request]:
        self._members.discard(req)
        released: list[Request] = []
        if req.is_finished:
            if hold:
                self._held.append(req)
            else:  # aborted or failed: nobody is served by holding those back
                released.append(req)
        if not self._members:
            released.extend(self._held)
            self._held = []
        return released


def make_batching_policy(config: SchedulerConfig) -> BatchingPolicy:
    return IterationBatching() if config.scheduling == "iteration" else RequestBatching()
