"""The policies: when KV blocks are taken (lazy / reserve) and when requests join and leave a batch
(iteration / request). The scheduler (scheduler.core) asks them; they hold no request queues."""

from __future__ import annotations

from abc import ABC, abstractmethod

from scheduler.block_allocator import BlockAllocator, BlockHash, blocks_for_tokens, hash_block
from scheduler.config import SchedulerConfig
from scheduler.request import Request

# The fewest tokens of a prompt that run in one step, but for a prompt of one token or a token budget
# too small to split it so: a chunk of one token would run through the decode attention kernel, and a
# prompt row must get the same bits whether its prompt came whole, in chunks or after a cached prefix
# (the prompt kernel's results depend on the row alone: models/kernels/paged_prefill_attention.c).
MIN_PROMPT_CHUNK = 2

# --------------------------------------------------------------------------------------------------
# KV policies


class KVPolicy(ABC):
    """Decides how many KV blocks a request takes, and when; with prefix caching, also which cached
    blocks a request starts from and when its computed blocks become cached."""

    # Whether running out of blocks preempts a running request (else it is a bug: the policy reserved).
    preempts: bool

    def __init__(self, allocator: BlockAllocator, max_model_len: int, kv_window: int | None = None) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_model_len = max_model_len
        self.kv_window = kv_window  # Executor.kv_window: blocks behind it are given back
        # What a given-back block's table entry names: the engine's scratch block (one past the
        # scheduler's, engine/kv_cache.py), which no request owns. Kernels skip keys behind a window;
        # one that read them would meet finite values (every block starts as zeros) and mask them.
        self.released_block = allocator.num_blocks

    @abstractmethod
    def _tokens_to_hold(self, req: Request, num_tokens_after: int) -> int:
        """Tokens a request's table must cover at admission, where the step leaves num_tokens_after
        computed."""

    def admit(self, req: Request, cached: list[int], num_new_tokens: int) -> bool:
        """Start a waiting request from `cached` (from cached_prefix) and take the blocks it needs to
        run num_new_tokens more. False, with nothing taken, if they are not free."""
        bs = self.block_size
        start = len(cached) * bs
        need = max(0, blocks_for_tokens(self._tokens_to_hold(req, start + num_new_tokens), bs) - len(cached))
        # A cached block nobody holds counts among the free ones: taking it uses one up.
        if need + self.allocator.num_unheld(cached) > self.allocator.num_free:
            return False
        self.allocator.take(cached)
        req.block_ids.extend(cached)
        self.allocator.append_blocks(req.block_ids, need)
        req.num_computed_tokens = start
        req.num_offered_blocks = len(cached)
        return True

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Take the blocks a running request needs to run num_new_tokens more. False if not free."""
        return self.allocator.ensure_capacity(req.block_ids, req.num_computed_tokens + num_new_tokens)

    def trim(self, req: Request) -> None:
        """After a verification rolled back rejected proposals: give back the blocks that held only
        those (past the request's tokens). Only a policy that takes blocks as tokens need them does."""
        return None

    def release(self, req: Request) -> None:
        # The tail first: it is evicted first. Entries behind the window were given back already.
        self.allocator.free(reversed(req.block_ids[req.num_released_blocks :]))
        req.block_ids.clear()
        req.num_offered_blocks = 0
        req.num_released_blocks = 0

    def release_behind_window(self, req: Request) -> None:
        """Give back the blocks that every layer's sliding window has left behind (vLLM frees a
        sliding-window layer group's blocks the same way): the request's next query is at position
        num_computed_tokens or later and sees keys from num_computed_tokens - kv_window + 1 on, so a
        block that ends before that is never read again. Called once a step's K/V exist (after
        offer_computed: a full block is cached first, and stays reusable as a prefix until evicted).
        A step already in flight carries the old entries, for keys it does not read either."""
        if self.kv_window is None:
            return
        behind = max(0, req.num_computed_tokens - self.kv_window + 1) // self.block_size
        start = req.num_released_blocks
        if behind <= start:
            return
        table = req.block_ids
        self.allocator.free(reversed(table[start:behind]))
        table[start:behind] = [self.released_block] * (behind - start)
        req.num_released_blocks = behind

    # ---- the prefix cache -------------------------------------------------------------------------

    def block_hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """The request's list of full-block names, grown to at least num_blocks (each one is computed
        once per request: a name depends only on the tokens up to its block's end)."""
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def num_cacheable_blocks(self, req: Request) -> int:
        """Blocks of the request that may come from the cache: the last token is always computed, since
        its logits give the next token, and so is the one before it: what follows a cached prefix is
        then a chunk of two tokens or more, which runs through the prompt attention kernel like the
        whole prompt would, never through the decode one (a row's result then does not depend on
        whether its prefix came from the cache; MIN_PROMPT_CHUNK). None for a request that scores
        its prompt (prompt logprobs need the logits at every prompt position, as in vLLM) nor for an
        embedding that pools over the first or every token (it needs their hidden states; "last" needs
        the last token's only)."""
        if req.sampling.prompt_logprobs is not None or req.pooling in ("mean", "cls"):
            return 0
        return max(0, req.num_tokens - MIN_PROMPT_CHUNK) // self.block_size

    def cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks that continue the request from its first uncomputed block: the longest run
        whose names match its tokens (nothing is taken). Empty unless that block starts at a block
        boundary and caching is on."""
        bs = self.block_size
        if not self.allocator.enable_caching or req.num_computed_tokens % bs:
            return []
        first = req.num_computed_tokens // bs
        last = self.num_cacheable_blocks(req)
        if first >= last:
            return []
        return self.allocator.lookup(self.block_hashes(req, last)[first:last])

    def extend_from_cache(self, req: Request) -> int:
        """Continue a running request mid-prompt from blocks another request has computed since it was
        admitted (it waited for them). Blocks it reserved past its computed tokens were never written
        and are given back. Returns the tokens it no longer has to compute."""
        cached = self.cached_prefix(req)
        if not cached:
            return 0
        first = req.num_computed_tokens // self.block_size
        table = req.block_ids
        self.allocator.take(cached)
        for i, block in enumerate(cached, start=first):
            if i < len(table):
                self.allocator.free([table[i]])
                table[i] = block
            else:
                table.append(block)
        req.num_computed_tokens += len(cached) * self.block_size
        req.num_offered_blocks = req.num_computed_tokens // self.block_size
        return len(cached) * self.block_size

    def offer_computed(self, req: Request) -> None:
        """Cache the request's blocks that its computed tokens have filled (called once a step's K/V
        exist, never at scheduling: a block a batch in flight is still writing must not be reused)."""
        if not self.allocator.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_offered_blocks:
            return
        hashes = self.block_hashes(req, full)
        for i in range(req.num_offered_blocks, full):
            self.allocator.cache(req.block_ids[i], hashes[i])
        req.num_offered_blocks = full


class LazyKV(KVPolicy):
    """vLLM's paging: a block is taken when a token needs it; the scheduler preempts when none is."""

    preempts = True

    def _tokens_to_hold(self, req: Request, num_tokens_after: int) -> int:
        return num_tokens_after

    def trim(self, req: Request) -> None:
        # Rejected proposals wrote K/V past the request's tokens; blocks holding nothing else carry no
        # name (only blocks full of computed tokens are cached), so they go back to the free list.
        keep = blocks_for_tokens(req.num_tokens, self.block_size)
        if len(req.block_ids) > keep:
            self.allocator.free(reversed(req.block_ids[keep:]))
            del req.block_ids[keep:]


class ReserveKV(KVPolicy):
    """ORCA's rule: reserve prompt + max_tokens at admission, so a running request never runs out.
    Blocks that come from the prefix cache are shared, not reserved again."""

    preempts = False

    def _tokens_to_hold(self, req: Request, num_tokens_after: int) -> int:
        # Outputs already made count against max_tokens (relevant only if a request was preempted
        # under another policy; reserve itself never preempts).
        remaining_outputs = req.sampling.max_tokens - req.num_output_tokens
        return min(req.num_tokens + remaining_outputs, self.max_model_len)


def make_kv_policy(
    config: SchedulerConfig, allocator: BlockAllocator, max_model_len: int, kv_window: int | None = None
) -> KVPolicy:
    cls = {"lazy": LazyKV, "reserve": ReserveKV}[config.kv_policy]
    return cls(allocator, max_model_len, kv_window)


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
