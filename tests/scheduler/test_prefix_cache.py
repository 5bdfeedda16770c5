"""Automatic prefix caching: the block pool (hashes, reference counts, LRU eviction) and the scheduler
over it (cached prefixes, blocks cached as they fill, n choices sharing one prompt, the in-flight rule,
both KV policies, both batching policies), against the fake runner, whose simulated KV cache checks
that every position a request reads holds exactly its own context."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
from fakes import cramped_runner, greedy_through_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import scheduler_configs

from engine.contract import SamplingParams
from scheduler.block_allocator import BlockAllocator, hash_block
from scheduler.config import SchedulerConfig
from scheduler.core import ScheduledStep, Scheduler
from scheduler.fake_runner import FakeRunner, hash_next_token
from scheduler.loop import IterationLoop
from scheduler.request import Request, RequestStatus

BS = 4  # block size of every scheduler test here


def expected_outputs(prompt: Sequence[int], n: int) -> list[int]:
    """The fake model's tokens for a prompt, generated one by one with nothing shared or cached."""
    context = list(prompt)
    for _ in range(n):
        context.append(hash_next_token(context))
    return context[len(prompt) :]


def tokens(seed: str, n: int) -> list[int]:
    return [10 + zlib.crc32(f"{seed}:{i}".encode()) % 1000 for i in range(n)]


def make(runner: FakeRunner, config: SchedulerConfig | None = None, **cfg) -> Scheduler:
    return Scheduler.for_executor(config or SchedulerConfig(**cfg), runner)


def request(rid: str, prompt: Sequence[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched: Scheduler, runner: FakeRunner) -> ScheduledStep:
    step = sched.schedule()
    sched.update(step, runner.step(step.seqs))
    return step


def drain(sched: Scheduler, runner: FakeRunner, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not sched.has_work():
            return
        run_step(sched, runner)
    raise AssertionError("no progress")


def check_pool(sched: Scheduler) -> None:
    """Reference counts equal the block tables' use; no evictable block is in a live table; every
    block is exactly one of held / free / evictable; every cached name maps back to its block."""
    alloc = sched.allocator
    for r in sched.requests.values():  # blocks behind a sliding window went back: their entries say so
        assert r.block_ids[: r.num_released_blocks] == [sched.kv.released_block] * r.num_released_blocks
    tables = [r.block_ids[r.num_released_blocks :] for r in sched.requests.values()]
    uses = Counter(b for t in tables for b in t)
    for b in range(alloc.num_blocks):
        assert alloc.ref_count(b) == uses[b], f"block {b}: {alloc.ref_count(b)} refs, {uses[b]} tables"
    assert alloc.num_used == len(uses)
    free, evictable = set(alloc._free), set(alloc._evictable)
    assert not free & evictable and not (free | evictable) & set(uses)
    assert len(free) + len(evictable) + len(uses) == alloc.num_blocks
    for h, b in alloc._cached.items():
        assert alloc.block_hash(b) == h
    assert {b for b in evictable} <= set(alloc._cached.values())


# ---- hashes and the pool ---------------------------------------------------------------------------


def test_block_names_chain_their_parents_and_are_sha256():
    a = hash_block(None, [1, 2, 3, 4])
    assert len(a) == 32 and a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])  # same tokens, other prefix
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 4, 3])
    assert hash_block(None, [2**40]) != hash_block(None, [0])  # ids are not truncated


def test_pool_keeps_freed_named_blocks_until_their_memory_is_needed():
    pool = BlockAllocator(num_blocks=4, block_size=BS, enable_caching=True)
    names = [hash_block(None, [i] * BS) for i in range(4)]
    a = pool.allocate(2)
    pool.cache(a[0], names[0])
    pool.cache(a[1], names[1])
    assert pool.lookup(names) == a and pool.num_cached == 2
    pool.free(reversed(a))  # the tail first
    assert pool.num_free == 4 and pool.num_used == 0 and pool.lookup(names[:2]) == a
    # Unnamed free blocks go first; cached ones only when nothing else is left, least recent first.
    b = pool.allocate(2)
    assert not set(b) & set(a) and pool.lookup(names[:2]) == a and pool.num_evictions == 0
    c = pool.allocate(1)
    assert c == [a[1]] and pool.lookup(names[:2]) == [a[0]] and pool.num_evictions == 1
    pool.take([a[0]])  # a hit: held again, no longer evictable
    assert pool.num_free == 0 and pool.ref_count(a[0]) == 1


def test_pool_refuses_what_would_corrupt_another_request():
    pool = BlockAllocator(num_blocks=3, block_size=BS, enable_caching=True)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.take([b])  # only cached blocks are shared
    pool.cache(b, hash_block(None, [1] * BS))
    (dup,) = pool.allocate(1)
    pool.cache(dup, hash_block(None, [1] * BS))  # same content computed twice: stays private
    assert pool.block_hash(dup) is None and pool.lookup([hash_block(None, [1] * BS)]) == [b]
    pool.take([b])
    pool.free([b, b])
    with pytest.raises(ValueError):
        pool.free([b])  # double free
    off = BlockAllocator(num_blocks=2, block_size=BS)
    (x,) = off.allocate(1)
    off.cache(x, hash_block(None, [1] * BS))
    assert off.lookup([hash_block(None, [1] * BS)]) == [] and off.num_cached == 0


# ---- the scheduler over it -------------------------------------------------------------------------


def test_a_repeated_prompt_starts_after_its_cached_blocks_and_gets_the_same_tokens():
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner)
    prompt = tokens("p", 18)  # 4 full blocks + 2 tokens
    first = request("a", prompt)
    sched.add(first)
    drain(sched, runner)
    assert first.num_cached_tokens == 0
    again = request("b", prompt)
    sched.add(again)
    step = run_step(sched, runner)
    assert [(s.start_position, s.num_tokens) for s in step.seqs] == [(16, 2)]
    drain(sched, runner)
    assert again.output_token_ids == first.output_token_ids == expected_outputs(prompt, 4)
    assert again.num_cached_tokens == 16
    stats = sched.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (36, 16)
    check_pool(sched)
    assert sched.allocator.num_used == 0 and stats.cached_blocks > 0


def test_the_last_prompt_token_is_always_computed():
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner)
    prompt = tokens("p", 16)  # exactly 4 blocks: at most 3 can be reused, the 4th has the last token
    for rid in ("a", "b"):
        sched.add(request(rid, prompt))
        drain(sched, runner)
    b_steps = [s for step in runner.history for s in step if s.request_id == "b"]
    assert (b_steps[0].start_position, b_steps[0].num_tokens) == (12, 4)


def test_a_next_turn_reuses_the_history_and_the_previous_reply():
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner)
    turn1 = request("t1", tokens("system+user", 10), max_tokens=9)
    sched.add(turn1)
    drain(sched, runner)
    history = [*turn1.prompt_token_ids, *turn1.output_token_ids]  # 19 tokens, 18 of them computed
    turn2 = request("t2", [*history, *tokens("user2", 5)])
    sched.add(turn2)
    drain(sched, runner)
    # Blocks filled by the reply's decode steps were cached too: 4 full blocks of the 19.
    assert turn2.num_cached_tokens == 16
    assert turn2.output_token_ids == expected_outputs(turn2.prompt_token_ids, 4)


def test_n_choices_compute_their_prompt_once():
    """Eight requests for one prompt: one computes it; the others wait (admitted, running nothing)
    and then start from its blocks, computing only the last partial block each."""
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner)
    prompt = tokens("shared", 30)  # 7 full blocks + 2 tokens
    choices = [request(f"c{i}", prompt) for i in range(8)]
    for r in choices:
        sched.add(r)
    first = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens) for s in first.seqs] == [("c0", 30)]
    assert len(sched.running) == 8  # the others joined: they hold their seats
    second = run_step(sched, runner)
    assert (
        sorted((s.start_position, s.num_tokens) for s in second.seqs if s.request_id != "c0") == [(28, 2)] * 7
    )
    drain(sched, runner)
    assert all(r.output_token_ids == expected_outputs(prompt, 4) for r in choices)
    assert sched.prefix_cache_stats().computed_prompt_tokens == 30 + 7 * 2
    assert [r.num_cached_tokens for r in choices] == [0] + [28] * 7
    check_pool(sched)


def chunking_scheduler() -> tuple[FakeRunner, Scheduler, list[int]]:
    """A 16-token step budget and a 70-token prompt: the prompt runs in 5 chunks."""
    runner = FakeRunner(num_kv_blocks=128, block_size=BS, max_model_len=512)
    return runner, make(runner, max_num_seqs=4, max_num_batched_tokens=16), tokens("long", 70)


def test_choices_follow_a_prompt_computed_in_chunks():
    runner, sched, prompt = chunking_scheduler()
    a, b = request("a", prompt), request("b", prompt)
    sched.add(a)
    sched.add(b)
    while a.num_computed_tokens < len(prompt):
        step = run_step(sched, runner)
        assert [s.request_id for s in step.seqs] == ["a"]  # b waits for each of a's chunks
    drain(sched, runner)
    assert b.num_cached_tokens == 68 and b.output_token_ids == a.output_token_ids
    assert sched.prefix_cache_stats().computed_prompt_tokens == 70 + 2


def test_a_request_arriving_mid_prompt_takes_the_blocks_computed_so_far():
    runner, sched, prompt = chunking_scheduler()
    a = request("a", prompt)
    sched.add(a)
    run_step(sched, runner)
    run_step(sched, runner)  # a has computed 32 tokens, 8 blocks, all cached already
    assert sched.allocator.num_cached == 8
    b = request("b", [*prompt[:40], *tokens("other", 10)])  # shares 10 blocks with a's prompt
    sched.add(b)
    drain(sched, runner)
    assert b.num_cached_tokens == 40 and b.output_token_ids == expected_outputs(b.prompt_token_ids, 4)


def test_a_waiting_choice_computes_the_prompt_itself_when_the_first_is_aborted():
    runner, sched, prompt = chunking_scheduler()
    a, b = request("a", prompt), request("b", prompt)
    sched.add(a)
    sched.add(b)
    run_step(sched, runner)
    sched.abort("a")
    drain(sched, runner)
    assert b.num_cached_tokens == 16  # a's first chunk, then b ran the rest itself
    assert b.output_token_ids == expected_outputs(prompt, 4)
    check_pool(sched)


def test_blocks_written_by_a_batch_in_flight_are_not_reused_before_it_is_applied():
    """The pipelined loop's rule: a block becomes cached when its batch's results are applied, never
    when it is scheduled, so a request in the next batch cannot read K/V that do not exist yet."""
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner)
    prompt = tokens("p", 13)
    a = request("a", prompt)
    sched.add(a)
    first = sched.schedule()  # a's prompt, in flight
    assert sched.allocator.num_cached == 0
    b = request("b", prompt)
    sched.add(b)
    second = sched.schedule(in_flight={"a"})
    assert second.seqs == [] and b.status is RequestStatus.RUNNING and b.block_ids == []
    sched.update(first, runner.step(first.seqs))
    third = sched.schedule(in_flight=set())
    # b reuses a's first two blocks: the third holds the prompt's last two tokens, always computed.
    assert [(s.request_id, s.start_position) for s in third.seqs] == [("a", 13), ("b", 8)]
    sched.update(third, runner.step(third.seqs))
    drain(sched, runner)
    assert b.output_token_ids == a.output_token_ids == expected_outputs(prompt, 4)


@pytest.mark.usefixtures("both_overlap_modes")
async def test_the_pipelined_loop_shares_prefixes_only_once_computed():
    """Prompts sharing a stem, and repeated prompts (n choices), through 2 batches in flight: the tokens
    of a run without caching, cache hits, and (the fake checks it at every submit) no request reads a
    block a batch in flight is still writing."""
    stem = tokens("stem", 40)
    prompts = [stem + tokens(f"tail{i}", 1 + i % 3) for i in range(4)] + [stem + [3, 3]] * 3
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)
    no_cache = replace(config, enable_prefix_caching=False)
    plain = await greedy_through_loop(FakeRunner(block_size=BS), prompts, 8, no_cache)
    fake = FakeRunner(block_size=BS, pipeline_depth=2)
    loop = IterationLoop(fake, config)
    assert await greedy_through_loop(fake, prompts, 8, config, loop) == plain
    assert loop.stats().prefix_cache.hits >= 6 * 36 and fake.max_in_flight == 2 and not fake.in_flight


def test_reserve_reserves_only_the_blocks_it_adds():
    runner = FakeRunner(num_kv_blocks=16, block_size=BS, max_model_len=64)
    sched = make(runner, kv_policy="reserve")
    prompt = tokens("p", 20)
    sched.add(request("a", prompt, max_tokens=8))  # 7 blocks
    drain(sched, runner)
    b = request("b", prompt, max_tokens=8)
    c = request("c", prompt, max_tokens=8)
    sched.add(b)
    sched.add(c)
    run_step(sched, runner)
    # Each shares the 4 cached prompt blocks and reserves 3 of its own: 4 + 3 + 3 held.
    assert sched.allocator.num_used == 10 and b.block_ids[:4] == c.block_ids[:4]
    drain(sched, runner)
    assert sched.num_preemptions == 0 and b.output_token_ids == expected_outputs(prompt, 8)
    check_pool(sched)


def test_a_full_cache_is_evicted_for_new_requests():
    runner = FakeRunner(num_kv_blocks=12, block_size=BS, max_model_len=48)
    sched = make(runner)
    for i in range(6):  # each leaves 4 cached blocks behind; 12 blocks in all
        r = request(f"r{i}", tokens(f"p{i}", 16))
        sched.add(r)
        drain(sched, runner)
        assert r.output_token_ids == expected_outputs(r.prompt_token_ids, 4)
        check_pool(sched)
    stats = sched.prefix_cache_stats()
    assert sched.allocator.num_used == 0 and stats.evictions > 0 and stats.cached_blocks <= 12


def test_preempted_requests_do_not_count_as_hits_and_recompute_exactly():
    runner = FakeRunner(num_kv_blocks=6, block_size=BS, max_model_len=24)
    sched = make(runner, max_num_seqs=4, max_num_batched_tokens=32)
    reqs = [request(f"r{i}", tokens(f"p{i}", 7), max_tokens=6) for i in range(3)]
    for r in reqs:
        sched.add(r)
    drain(sched, runner)
    assert sched.num_preemptions > 0
    assert all(r.output_token_ids == expected_outputs(r.prompt_token_ids, 6) for r in reqs)
    assert sched.prefix_cache_stats().hits == 0 and all(r.num_cached_tokens == 0 for r in reqs)


def test_caching_off_shares_nothing():
    runner = FakeRunner(num_kv_blocks=64, block_size=BS)
    sched = make(runner, enable_prefix_caching=False)
    prompt = tokens("p", 18)
    for rid in ("a", "b"):
        sched.add(request(rid, prompt))
    drain(sched, runner)
    stats = sched.prefix_cache_stats()
    assert (stats.queries, stats.hits, stats.cached_blocks) == (0, 0, 0)
    assert stats.computed_prompt_tokens == 36


# ---- random workloads with shared prefixes ---------------------------------------------------------


@st.composite
def shared_prefix_workloads(draw):
    """Requests whose prompts are one of a few stems (with a cut) plus their own tail, arriving over
    the first steps, some of them aborted or finished early."""
    stems = [tokens(f"stem{k}", 24) for k in range(3)]
    n = draw(st.integers(1, 10))
    arrivals = []
    for _ in range(n):
        stem = stems[draw(st.integers(0, 2))][: draw(st.integers(0, 24))]
        tail = draw(st.lists(st.integers(10, 40), max_size=6))
        prompt = stem + tail or [11]
        arrivals.append((draw(st.integers(0, 20)), prompt, draw(st.integers(1, 10))))
    arrivals.sort(key=lambda a: a[0])
    ends = {draw(st.integers(0, 40)): draw(st.integers(0, n - 1)) for _ in range(draw(st.integers(0, 3)))}
    return arrivals, ends


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    wl=shared_prefix_workloads(),
    config=scheduler_configs(max_extra_budget=20),
    extra_blocks=st.integers(0, 10),
    depth=st.sampled_from([1, 2]),
    window=st.sampled_from([None, 1, 5, 8]),
)
def test_random_shared_prefix_workloads_keep_every_invariant(wl, config, extra_blocks, depth, window):
    """Reference counts match the tables, nothing leaks or is freed twice, an evicted block is never
    in a live table, a block being written by a batch in flight is never read by another request,
    every output is the unshared one, and at the end no block is held (cached ones remain). With a
    sliding window on every layer (`window`), blocks behind it go back as requests move on, and what
    the windows still reach is each request's own context (the fake runner reads it back)."""
    arrivals, ends = wl
    longest = max(len(p) + m for _, p, m in arrivals)
    runner = cramped_runner(longest, BS, extra_blocks, kv_window=window)
    sched = make(runner, config)
    reqs = [request(f"r{i}", p, m) for i, (_, p, m) in enumerate(arrivals)]
    pending = list(zip(arrivals, reqs, strict=True))
    in_flight: list[tuple[ScheduledStep, list]] = []  # (step, its sampled tokens), oldest first
    step_no = 0
    while pending or sched.has_work() or in_flight:
        while pending and pending[0][0][0] <= step_no:
            sched.add(pending.pop(0)[1])
        if step_no in ends:
            sched.abort(reqs[ends[step_no]].request_id)
        busy = {r.request_id for s, _ in in_flight for r in s.requests}
        writing = {
            s.block_table[pos // BS]
            for st_, _ in in_flight
            for s in st_.seqs
            for pos in range(s.start_position, s.context_len)
        }
        step = sched.schedule(in_flight=busy) if len(in_flight) < depth else ScheduledStep()
        check_pool(sched)
        for seq in step.seqs:  # what a request reads without writing it must already exist
            first_read = max(0, seq.start_position - window + 1) if window else 0
            read_only = set(seq.block_table[first_read // BS : seq.start_position // BS])
            assert not read_only & writing, f"{seq.request_id} reads a block a batch in flight writes"
        if step.seqs:
            in_flight.append((step, runner.step(step.seqs)))  # K/V written now, applied later
        if in_flight and (len(in_flight) >= depth or not step.seqs):
            done, sampled = in_flight.pop(0)
            sched.update(done, sampled)
            check_pool(sched)
        step_no += 1
        assert step_no < 5000, "no progress"
    assert sched.allocator.num_used == 0 and not sched.requests and not sched._claimed
    for r in reqs:
        assert r.is_finished and r.status is not RequestStatus.FINISHED_ERROR
        assert r.output_token_ids == expected_outputs(r.prompt_token_ids, r.num_output_tokens)
        assert r.num_cached_tokens <= r.num_prompt_tokens - 1
