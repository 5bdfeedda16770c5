"""The synchronous scheduler: builds each iteration's batch and applies its sampled tokens.

No asyncio and no threads here (scheduler.loop drives it), so every decision is testable directly:
`schedule()` -> run the batch -> `update()`; `abort()` between steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace

from engine.contract import (
    PENDING_TOKEN,
    Executor,
    PooledState,
    PromptLogprobs,
    SampledToken,
    ScheduledSequence,
    StepResult,
)
from scheduler.block_allocator import BlockAllocator, BlockHash, blocks_for_tokens
from scheduler.config import SchedulerConfig
from scheduler.outputs import FinishReason, PrefixCacheStats, SchedulerStats, SpecStats
from scheduler.policy import MIN_PROMPT_CHUNK, make_batching_policy, make_kv_policy
from scheduler.request import Request, RequestStatus
from scheduler.speculation import Proposal, SpeculationPolicy
from scheduler.stop import check_stop

# The status a stop rule's reason puts a request in.
_STOPPED = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
}


@dataclass
class ScheduledStep:
    """One iteration's batch, and what scheduling it did to other requests."""

    seqs: list[ScheduledSequence] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # requests[i] runs seqs[i]
    num_prompt_tokens: int = 0  # prompt tokens, and outputs recomputed after a preemption
    num_decode_tokens: int = 0
    num_spec_tokens: int = 0  # proposed tokens to verify (speculative decoding)
    preempted: list[Request] = field(default_factory=list)
    # Requests finished while scheduling (they can never fit) or handed back by the batching policy;
    # the caller sends their final delta.
    released: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_decode_tokens + self.num_spec_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Waiting queue (FCFS, preempted requests at the front), running list (in admission order),
    KV blocks, and the stop conditions."""

    @classmethod
    def for_executor(cls, config: SchedulerConfig, executor: Executor) -> Scheduler:
        """A scheduler over an executor's KV cache. A request longer than the whole cache could never run
        (reserve) or would preempt itself forever (lazy), so the cache's capacity caps the length as
        the model's limit does."""
        max_len = min(executor.max_model_len, executor.num_kv_blocks * executor.block_size)
        return cls(
            config,
            executor.num_kv_blocks,
            executor.block_size,
            max_len,
            executor.eos_token_ids,
            draft_model_cost=executor.draft_model_cost,
            kv_window=executor.kv_window,
        )

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Set[int],
        draft_model_cost: float | None = None,
        kv_window: int | None = None,
    ) -> None:
        """`draft_model_cost`: the executor's (Executor.draft_model_cost): None when it has no draft
        model, which `speculative="draft"` needs. `kv_window`: the executor's (Executor.kv_window):
        KV blocks behind it are given back as requests move on."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = BlockAllocator(num_kv_blocks, block_size, config.enable_prefix_caching)
        self.kv = make_kv_policy(config, self.allocator, max_model_len, kv_window)
        self.batching = make_batching_policy(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # not yet handed back, finished-but-held included
        self.num_preemptions = 0
        # Prompt blocks a running request is computing, by name (its claim): a request whose next block
        # is claimed by another waits for it instead of computing it again (the n choices of one
        # prompt, or two conversations arriving together with one system prompt).
        self._claimed: dict[BlockHash, Request] = {}
        self._claims: dict[Request, tuple[list[BlockHash], int]] = {}  # names, and tokens when done
        self._cache_stats = PrefixCacheStats()
        self.speculation = make_speculation_policy(config, draft_model_cost)
        self._spec_stats = SpecStats()

    # ---- requests in and out ----------------------------------------------------------------------

    def validate(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, pooling: bool = False
    ) -> None:
        """Raise ValueError for a request that must not be queued (the server maps it to HTTP 400).
        An embedding request (`pooling`) generates nothing: its input alone must fit the context."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if pooling:
            if num_prompt_tokens > self.max_model_len:
                raise ValueError(
                    f"the input ({num_prompt_tokens} tokens) exceeds the model's maximum context length "
                    f"({self.max_model_len} tokens)"
                )
        elif max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"maximum context length ({self.max_model_len} tokens)"
            )
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add(self, req: Request) -> None:
        self.validate(
            req.request_id, req.num_prompt_tokens, req.sampling.max_tokens, pooling=req.pooling is not None
        )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def get(self, request_id: str) -> Request | None:
        """A request not yet handed back (finished-but-held included)."""
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters (num_steps is the loop's: 0 here)."""
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_total=self.allocator.num_blocks,
            num_preemptions=self.num_preemptions,
            num_steps=0,
            prefix_cache=self.prefix_cache_stats(),
            speculation=replace(self._spec_stats),
        )

    def abort_all(self) -> list[Request]:
        """Abort every request (shutdown). Returns the requests to send a final delta to."""
        released: list[Request] = []
        for request_id in list(self.requests):
            released += self.abort(request_id)
        return released

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A copy of the prefix cache's counters (all zero but computed tokens when caching is off)."""
        s = self._cache_stats
        return PrefixCacheStats(
            queries=s.queries,
            hits=s.hits,
            computed_prompt_tokens=s.computed_prompt_tokens,
            cached_blocks=self.allocator.num_cached,
            evictions=self.allocator.num_evictions,
        )

    def abort(self, request_id: str) -> list[Request]:
        """End a request (client gone, shutdown). Returns the requests to send a final delta to."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:  # unknown, or finished and held by `request` batching
            return []
        return self._finish(req, RequestStatus.FINISHED_ABORTED, hold=False)

    def fail(self, reqs: Sequence[Request], message: str) -> list[Request]:
        """Finish requests with an error (their step raised). Returns those to send a final delta."""
        released: list[Request] = []
        for req in reqs:
            if not req.is_finished:
                req.error = message
                released += self._finish(req, RequestStatus.FINISHED_ERROR, hold=False)
        return released

    def kv_cache_lost(self, message: str) -> list[Request]:
        """The engine's KV cache is gone (its workers were restarted): the running requests, whose
        context was there, fail; waiting and preempted ones hold nothing there and stay queued.
        Cached prefixes are forgotten: their blocks hold nothing now. Returns the requests to send a
        final delta to."""
        failed = self.fail(list(self.running), message)
        self.allocator.forget_cached()
        return failed

    def _finish(self, req: Request, status: RequestStatus, hold: bool) -> list[Request]:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = status
        req.finish_time = time.monotonic()
        self._release(req)
        released = self.batching.on_left(req, hold)
        for r in released:
            del self.requests[r.request_id]
        return released

    # ---- one iteration ----------------------------------------------------------------------------

    def schedule(
        self,
        in_flight: Set[str] = frozenset(),
        max_seqs: int | None = None,
        pending: ScheduledStep | None = None,
    ) -> ScheduledStep:
        """Pick this iteration's work: running decodes, then prompt chunks in progress, then new
        requests in arrival order, under max_num_seqs, max_num_batched_tokens and the KV blocks.

        `in_flight`: ids of requests in batches that are still running (pipeline parallelism keeps
        several batches in flight, as ORCA does). They are neither scheduled again nor preempted until
        their batch's tokens are applied: a request is in at most one in-flight batch. `max_seqs` caps
        this batch below max_num_seqs (the pipelined loop spreads the requests over its batches).

        `pending`: overlapped scheduling (docs/architecture.md, "Overlapped scheduling"): the step that
        is running while this one is scheduled, its tokens not applied yet. Its requests are in flight
        as above, except that a plain decode continues in this step as if it had emitted its token:
        one row at the next position whose token id is PENDING_TOKEN (the loop puts the token the
        pending step sampled there before the forward: scheduler/overlap.py), and a prompt chunk that
        samples nothing continues with its next chunk (`_carry`)."""
        step = ScheduledStep()
        # Tokens each scheduled request runs, in batch order (a dict: a victim can be taken out again).
        chosen: dict[Request, int] = {}
        budget = self.config.max_num_batched_tokens
        carried: dict[Request, tuple[int, int]] = {}  # request -> start and tokens of its row
        if pending is not None:
            in_flight = in_flight | {r.request_id for r in pending.requests}
            carried = self._carry(pending, max_seqs, budget)
            budget -= sum(n for _, n in carried.values())

        ready = [r for r in self.running if r.request_id not in in_flight] if in_flight else self.running
        decodes = [r for r in ready if r.num_uncomputed_tokens == 1]
        prefills = [r for r in ready if r.num_uncomputed_tokens > 1]
        for req in decodes + prefills:
            if max_seqs is not None and len(chosen) + len(carried) >= max_seqs:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            if req.num_uncomputed_tokens > 1 and self.allocator.enable_caching:
                self._take_from_cache(req, self.kv.extend_from_cache(req))
                if self._waits_for_prefix(req):
                    continue
            n = self._prompt_share(req.num_uncomputed_tokens, budget, alone=not chosen)
            if n == 0:
                continue
            while not self.kv.grow(req, n):
                # The most recently admitted (that is not in flight: its batch still writes its blocks).
                victim = next((r for r in reversed(self.running) if r.request_id not in in_flight), None)
                if victim is None and in_flight:
                    n = 0  # every other request is in flight: try again once their tokens are applied
                    break
                if not self.kv.preempts or len(self.running) == 1 or victim is None:
                    # Cannot happen when max_model_len fits the cache (IterationLoop ensures it); fail
                    # the request rather than loop forever.
                    req.error = "out of KV cache blocks"
                    step.released += self._finish(req, RequestStatus.FINISHED_ERROR, hold=False)
                    break
                budget += chosen.pop(victim, 0)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING and n:
                chosen[req] = n
                budget -= n
                self._claim(req)

        # No admission in a step that preempted: the blocks just freed would otherwise go to the next
        # waiting request and the victim would be preempted again at once (thrashing).
        if not step.preempted and self.batching.may_admit():
            cap = None if max_seqs is None else max_seqs - len(carried)
            budget = self._admit(step, chosen, budget, cap)
        # Carried rows first (decodes of the step in flight, whose token is the pending one; prompt
        # chunks: the next chunk), then the chosen ones with their proposals.
        rows = [(req, start, n, None, start >= req.num_tokens) for req, (start, n) in carried.items()]
        # Proposals last, from what is left of the budget and the free blocks: they never preempt nor
        # hold back anybody's own tokens.
        spec = self._propose(
            [r for r in decodes if chosen.get(r) == 1 and r.pooling is None],
            budget,
            carried_decodes=sum(1 for *_, pending in rows if pending),
        )

        now = time.monotonic()
        rows += [(req, req.num_computed_tokens, n, spec.get(req), False) for req, n in chosen.items()]
        for req, start, n, proposal, pending in rows:
            step.seqs.append(self._row(req, start, start + n, proposal, pending))
            step.requests.append(req)
            if n == 1 and start >= req.num_prompt_tokens:
                step.num_decode_tokens += 1
            else:
                step.num_prompt_tokens += n
            step.num_spec_tokens += proposal.count if proposal is not None else 0
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return step

    def _row(
        self, req: Request, start: int, end: int, proposal: Proposal | None, pending: bool
    ) -> ScheduledSequence:
        """Request `req`'s row for positions [start, end): its tokens, or PENDING_TOKEN for a carried
        decode whose token the step in flight samples; `proposal`'s tokens to verify after them."""
        k = proposal.count if proposal is not None else 0
        return ScheduledSequence(
            request_id=req.request_id,
            token_ids=(PENDING_TOKEN,) if pending else req.token_slice(start, end),
            start_position=start,
            block_table=req.block_ids[: blocks_for_tokens(end + k, self.allocator.block_size)],
            sample=(pending or end == req.num_tokens) and req.pooling is None,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            num_prompt_scored=0 if pending else req.prompt_tokens_to_score(start, end),
            spec_token_ids=proposal.token_ids if proposal is not None else (),
            num_spec_tokens=k,
            pooling=req.pooling,
        )

    def _carry(
        self, pending: ScheduledStep, max_seqs: int | None, budget: int
    ) -> dict[Request, tuple[int, int]]:
        """The pending step's requests that continue in the next step before its tokens are applied
        (overlapped scheduling), each with the start and length of its row there, within `budget`
        tokens: decodes first, then prompt chunks, as schedule() orders them.

        A sampled row is carried only where the pending step certainly leaves the request one token
        further and the next row needs nothing but that token: no proposals to verify (how many are
        accepted is unknown), not ending by length at that token, and not a request speculation would
        rather propose for. (A grammar is no obstacle: its matcher is advanced past the token on the
        worker's side, when the row's mask is made, after the token is put in.) A
        prompt chunk that samples nothing is continued by its next chunk, unless a block it would
        compute is another request's to compute (it waits for it, as in schedule()). The others
        wait for the step's tokens, as in a synchronous loop. A carried request whose pending token
        ends it (EOS, a stop string) has run one row for nothing: the loop discards it. A carried row
        never preempts (every other request may be in flight): without free blocks it waits."""
        out: dict[Request, tuple[int, int]] = {}
        limit = max_seqs if max_seqs is not None else self.config.max_num_seqs
        rows = [
            (req, seq)
            for req, seq in zip(pending.requests, pending.seqs, strict=True)
            if req.status is RequestStatus.RUNNING and not seq.num_spec_tokens
        ]
        for req, seq in [r for r in rows if r[1].sample] + [r for r in rows if not r[1].sample]:
            if len(out) >= limit or budget <= 0:
                break
            start = seq.start_position + seq.num_tokens
            if seq.sample:
                n = 1
                if (
                    req.num_output_tokens + 1 >= req.sampling.max_tokens
                    or req.num_tokens + 1 >= self.max_model_len
                    or (
                        self.speculation is not None
                        and self.speculation.worth_waiting(req, len(self.running))
                    )
                ):
                    continue
            else:
                n = self._prompt_share(req.num_tokens - start, budget, alone=False)
                if n == 0 or (self.allocator.enable_caching and self._waits_for_prefix(req, start)):
                    continue
            if self.kv.grow(req, start + n - req.num_computed_tokens):
                out[req] = (start, n)
                budget -= n
        return out

    def _propose(
        self, decodes: list[Request], spare: int, carried_decodes: int = 0
    ) -> dict[Request, Proposal]:
        """This step's proposals for its decoding requests (none with speculation off), within `spare`
        tokens of budget, each with the blocks for its positions if they are free (else none). The
        policy weighs them against the whole decode batch: `carried_decodes` more rows (overlapped
        scheduling's, which cannot propose) share the step."""
        if self.speculation is None or not decodes:
            return {}
        out: dict[Request, Proposal] = {}
        bs = self.allocator.block_size
        batch = len(decodes) + carried_decodes
        for i, proposal in self.speculation.plan(decodes, spare, self.max_model_len, batch).items():
            req = decodes[i]
            # Cut to the positions its blocks and the free ones hold.
            room = (len(req.block_ids) + self.allocator.num_free) * bs - req.num_computed_tokens - 1
            k = min(proposal.count, room)
            if k > 0 and self.kv.grow(req, 1 + k):
                out[req] = Proposal(k, proposal.token_ids[:k])
        return out

    def _prompt_share(self, num_uncomputed: int, budget: int, alone: bool) -> int:
        """Tokens of a prompt (or of a recompute) to run this step: 0 if it must wait. A chunk of a
        longer prompt is MIN_PROMPT_CHUNK tokens or more and leaves as many, unless the whole budget
        is smaller."""
        if self.config.chunked_prefill:
            share = min(num_uncomputed, budget)
            if share == num_uncomputed:
                return share
            fitted = min(share, num_uncomputed - MIN_PROMPT_CHUNK)
            if fitted >= MIN_PROMPT_CHUNK:
                return fitted
            return 0 if budget < self.config.max_num_batched_tokens else share
        if num_uncomputed <= budget:
            return num_uncomputed
        # Without chunking a prompt longer than the whole budget would never fit: it runs alone.
        return num_uncomputed if alone and budget == self.config.max_num_batched_tokens else 0

    def _admit(
        self, step: ScheduledStep, chosen: dict[Request, int], budget: int, max_seqs: int | None = None
    ) -> int:
        """Move waiting requests to running, first come first served; stop at the first that does not
        fit (ORCA's Select(): never skip ahead, so a long request cannot starve). Returns the budget
        left."""
        uses_budget = self.batching.admission_uses_token_budget
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if max_seqs is not None and len(chosen) >= max_seqs:
                break
            req = self.waiting[0]
            cached = self.kv.cached_prefix(req)
            start = len(cached) * self.allocator.block_size
            # A request whose next block another is computing joins without running (no budget): it
            # continues from that block once it is cached.
            waits = self._waits_for_prefix(req, start)
            n = 0 if waits else self._prompt_share(req.num_tokens - start, budget, alone=not chosen)
            if n == 0 and uses_budget and not waits:
                break
            if not self.kv.admit(req, cached, n):
                if self.running:
                    break
                # Alone and still no room: it never will fit (IterationLoop's length check prevents it).
                req.error = "the request does not fit in the KV cache"
                step.released += self._finish(req, RequestStatus.FINISHED_ERROR, hold=False)
                continue
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING and self.allocator.enable_caching:
                self._cache_stats.queries += req.num_tokens  # first admission only, as vLLM counts
            self._take_from_cache(req, start)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.batching.on_admitted(req)
            if n:
                chosen[req] = n
                budget -= n
                self._claim(req)
        return budget

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        """Free the request's blocks and put it at the front of the queue, to be recomputed from its
        prompt + outputs so far (its outputs are kept, so nothing is emitted twice)."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)
        for r in self.batching.on_left(req, hold=False):
            del self.requests[r.request_id]
            step.released.append(r)

    # ---- prefix caching ---------------------------------------------------------------------------

    def _take_from_cache(self, req: Request, num_tokens: int) -> None:
        """Account for prompt tokens the request took from the cache instead of computing them."""
        if num_tokens and req.num_preemptions == 0:  # a recompute is not a prompt's cache hit
            req.num_cached_tokens += num_tokens
            self._cache_stats.hits += num_tokens

    def _waits_for_prefix(self, req: Request, start: int | None = None) -> bool:
        """Whether the block the request would compute next (from `start`, default its computed
        tokens) is one another running request is computing: it waits, and takes it from the cache."""
        if not self._claimed:
            return False
        start = req.num_computed_tokens if start is None else start
        bs = self.allocator.block_size
        i = start // bs
        if start % bs or i >= self.kv.num_cacheable_blocks(req):
            return False
        owner = self._claimed.get(self.kv.block_hashes(req, i + 1)[i])
        return owner is not None and owner is not req

    def _claim(self, req: Request) -> None:
        """Claim the full prompt blocks a request is starting to compute (once per prompt phase)."""
        if not self.allocator.enable_caching or req in self._claims or req.num_uncomputed_tokens <= 1:
            return
        bs = self.allocator.block_size
        first, end = -(-req.num_computed_tokens // bs), req.num_tokens // bs
        if first >= end:
            return
        names = self.kv.block_hashes(req, end)[first:end]
        mine = [h for h in names if self._claimed.setdefault(h, req) is req]
        self._claims[req] = (mine, end * bs)

    def _unclaim(self, req: Request) -> None:
        claim = self._claims.pop(req, None)
        if claim is not None:
            for h in claim[0]:
                del self._claimed[h]

    def _release(self, req: Request) -> None:
        self._unclaim(req)
        self.kv.release(req)

    def update(self, step: ScheduledStep, sampled: Sequence[StepResult]) -> list[Request]:
        """Apply a step's sampled tokens (and their text) and check the stop rules, so a request that
        stops, by a stop string too, has freed its blocks before the next schedule().

        Returns the requests with something to hand out: new tokens (when the batching policy
        streams) or a final delta. Raises ValueError, changing nothing, if `sampled` does not match
        the step (the caller then fails the step's requests).
        """
        self._check_sampled(step, sampled)
        self._cache_stats.computed_prompt_tokens += step.num_prompt_tokens
        now = time.monotonic()
        out: list[Request] = []
        for req, seq, tok in zip(step.requests, step.seqs, sampled, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue
            scored = _scored(tok)
            if scored is not None:
                req.add_prompt_logprobs(seq.start_position, scored)
            if isinstance(tok, PooledState):
                req.add_pooled(seq.start_position, tok)
            reason: FinishReason | None = None
            computed = seq.num_tokens
            if isinstance(tok, SampledToken):  # else a prompt chunk that is not the last
                # Token by token, so that a stop rule drops whatever the step produced after it.
                kept = 0
                for t in tok.tokens:
                    req.output_token_ids.append(t.token_id)
                    if req.sampling.logprobs is not None:  # then t.logprob is set (_check_sampled)
                        req.output_text.add(t.token_id, t.logprob, t.top_logprobs)
                    else:
                        req.output_text.add(t.token_id)
                    kept += 1
                    reason = check_stop(req, self.eos_token_ids, self.max_model_len)
                    if reason is not None:
                        break
                # The accepted proposals' K/V are computed too (rolled back to them: the slots of
                # rejected ones are rewritten by later steps, and no block holding them is cached).
                computed += min(tok.num_accepted, kept)
                if seq.num_spec_tokens:
                    self._spec_stats.record(seq.num_spec_tokens, tok.num_accepted)
                    if self.speculation is not None:
                        self.speculation.record(req, seq.num_spec_tokens, tok.num_accepted)
                if req.first_token_time is None:
                    req.first_token_time = now
            req.num_computed_tokens += computed
            self.kv.offer_computed(req)
            self.kv.release_behind_window(req)
            claim = self._claims.get(req)
            if claim is not None and req.num_computed_tokens >= claim[1]:
                self._unclaim(req)
            if req.pooling is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                reason = FinishReason.STOP  # an embedding is done once its prompt is: it frees its blocks
            if reason is not None:
                out += self._finish(req, _STOPPED[reason], hold=True)
                continue
            if seq.num_spec_tokens:
                self.kv.trim(req)
            if isinstance(tok, SampledToken) and self.batching.streams:
                out.append(req)
        return out

    @staticmethod
    def _check_sampled(step: ScheduledStep, sampled: Sequence[StepResult]) -> None:
        if len(sampled) != len(step.seqs):
            raise ValueError(f"the runner returned {len(sampled)} results for {len(step.seqs)} sequences")
        for seq, tok in zip(step.seqs, sampled, strict=True):
            if seq.sample and not isinstance(tok, SampledToken):
                raise ValueError(f"the runner sampled no token for {seq.request_id!r}")
            if seq.pooling is not None and not isinstance(tok, PooledState):
                raise ValueError(f"the runner pooled nothing for {seq.request_id!r}")
            scored = _scored(tok)
            if seq.num_prompt_scored and (scored is None or len(scored.logprobs) != seq.num_prompt_scored):
                raise ValueError(f"the runner scored the wrong prompt tokens for {seq.request_id!r}")
            if not isinstance(tok, SampledToken):
                continue
            if tok.num_verified != seq.num_spec_tokens or len(tok.following) > seq.num_spec_tokens:
                raise ValueError(f"the runner verified the wrong proposals for {seq.request_id!r}")
            if seq.sampling.logprobs is not None and any(t.logprob is None for t in tok.tokens):
                raise ValueError(f"the runner returned no logprob for {seq.request_id!r}")


def _scored(result: StepResult) -> PromptLogprobs | None:
    """The prompt logprobs a step's result for one entry carries, if any."""
    if isinstance(result, PromptLogprobs):
        return result
    return result.prompt_logprobs if isinstance(result, SampledToken) else None


def make_speculation_policy(
    config: SchedulerConfig, draft_model_cost: float | None
) -> SpeculationPolicy | None:
    """The policy for config.speculative ("auto": the draft model where there is one, else n-gram)."""
    method = config.speculative
    if method == "off":
        return None
    if method == "auto":
        method = "draft" if draft_model_cost is not None else "ngram"
    if method == "draft" and draft_model_cost is None:
        raise ValueError(
            "speculative decoding with a draft model needs one: start the engine with --draft-model"
        )
    return SpeculationPolicy(
        method,
        max_tokens=config.num_speculative_tokens,
        max_batch=config.speculative_max_batch,
        token_cost=config.speculative_token_cost,
        draft_cost=draft_model_cost or 0.0,
    )
