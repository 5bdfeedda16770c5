"""The synchronous scheduler (scheduler.core) against the fake runner: pure Python, milliseconds."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from fakes import cramped_runner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import scheduler_configs

from engine.contract import SampledToken, SamplingParams
from scheduler.block_allocator import BlockAllocator, NoFreeBlocksError, blocks_for_tokens
from scheduler.config import SchedulerConfig
from scheduler.core import ScheduledStep, Scheduler
from scheduler.fake_runner import FakeDetokenizer, FakeRunner, hash_next_token
from scheduler.output_text import OutputText, start_output
from scheduler.outputs import FinishReason
from scheduler.request import Request, RequestStatus
from scheduler.stop import check_stop

EOS = 2
DETOK = FakeDetokenizer()


def expected_outputs(prompt: Sequence[int], n: int) -> list[int]:
    """The fake model's tokens for a prompt, generated one by one with no batching at all."""
    context = list(prompt)
    for _ in range(n):
        context.append(hash_next_token(context))
    return context[len(prompt) :]


def make(runner: FakeRunner, config: SchedulerConfig | None = None, **cfg) -> Scheduler:
    return Scheduler.for_executor(config or SchedulerConfig(**cfg), runner)


def prompt_of(rid: str, prompt_len: int) -> list[int]:
    return [10 + zlib.crc32(f"{rid}:{i}".encode()) % 1000 for i in range(prompt_len)]  # stable across runs


def req(rid: str, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    prompt = prompt_of(rid, prompt_len)
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, prompt, sampling, output_text=start_output(DETOK, prompt, sampling))


def embedding_req(rid: str, prompt_len: int, pooling: str) -> Request:
    prompt = prompt_of(rid, prompt_len)
    return Request(rid, prompt, SamplingParams(), output_text=OutputText.without_text(), pooling=pooling)


def pooled(runner: FakeRunner, tokens: Sequence[int], pooling: str) -> list[float]:
    """Reference: the fake model's states over `tokens`, pooled."""
    states = [runner.hidden_state(tokens[: i + 1]) for i in range(len(tokens))]
    if pooling == "mean":
        return [sum(column) / len(tokens) for column in zip(*states, strict=True)]
    return states[-1] if pooling == "last" else states[0]


def run_step(sched: Scheduler, runner: FakeRunner) -> tuple[ScheduledStep, list[Request]]:
    step = sched.schedule()
    return step, sched.update(step, runner.step(step.seqs))


def drain(sched: Scheduler, runner: FakeRunner, limit: int = 10_000) -> int:
    steps = 0
    while sched.has_work():
        run_step(sched, runner)
        steps += 1
        assert steps < limit, "no progress"
    return steps


def used_blocks(sched: Scheduler) -> int:
    return sum(len(r.block_ids) for r in sched.requests.values())


# ---- the allocator ---------------------------------------------------------------------------------


def test_allocator_counts_and_errors():
    a = BlockAllocator(num_blocks=5, block_size=4)
    table: list[int] = []
    assert a.ensure_capacity(table, 9) and len(table) == 3  # ceil(9 / 4)
    assert a.ensure_capacity(table, 12) and len(table) == 3  # still fits
    assert (a.num_used, a.num_free) == (3, 2)
    assert not a.ensure_capacity(table, 21)  # needs 3 more, 2 free: takes nothing
    assert a.num_free == 2
    with pytest.raises(NoFreeBlocksError):
        a.allocate(3)
    a.free(table)
    assert a.num_free == 5 and len(set(table)) == 3
    with pytest.raises(ValueError):
        a.free(table[:1])  # double free
    assert blocks_for_tokens(0, 4) == 0 and blocks_for_tokens(4, 4) == 1 and blocks_for_tokens(5, 4) == 2


# ---- validation and config -------------------------------------------------------------------------


def test_validation_rejects_bad_requests():
    sched = make(FakeRunner(num_kv_blocks=8, block_size=4, max_model_len=64))  # capacity 32 < 64
    with pytest.raises(ValueError, match="empty"):
        sched.add(req("a", 0))
    with pytest.raises(ValueError, match="maximum context length"):
        sched.add(req("a", 30, max_tokens=3))  # 33 > 32 tokens of KV cache
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(req("a", 3, max_tokens=0))
    sched.add(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(req("a", 3))


def test_config_rejects_a_budget_below_max_num_seqs():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError):
        SchedulerConfig(scheduling="fifo")  # type: ignore[arg-type]


# ---- stop conditions -------------------------------------------------------------------------------


def eos_at(context_len: int):
    """A fake model that says EOS once the context reaches context_len tokens."""
    return lambda ctx: EOS if len(ctx) >= context_len else hash_next_token(ctx)


def finish_one(runner: FakeRunner, r: Request, **cfg) -> Request:
    sched = make(runner, **cfg)
    sched.add(r)
    drain(sched, runner)
    assert sched.allocator.num_free == runner.num_kv_blocks
    return r


def test_stop_on_eos():
    r = finish_one(FakeRunner(token_fn=eos_at(7)), req("a", 5, max_tokens=10))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids[-1] == EOS and len(r.output_token_ids) == 3  # contexts 5, 6 -> tokens; 7 -> EOS


def test_eos_ignored_with_ignore_eos():
    r = finish_one(FakeRunner(token_fn=eos_at(7)), req("a", 5, max_tokens=10, ignore_eos=True))
    assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 10


def test_eos_ignored_before_min_tokens():
    r = finish_one(FakeRunner(token_fn=eos_at(7)), req("a", 5, max_tokens=10, min_tokens=5))
    assert r.status is RequestStatus.FINISHED_STOPPED and len(r.output_token_ids) == 5


def test_stop_token_ids():
    stop = expected_outputs(req("a", 5).prompt_token_ids, 3)[2]
    r = finish_one(FakeRunner(), req("a", 5, max_tokens=10, stop_token_ids=(stop,)))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids[-1] == stop
    assert len(r.output_token_ids) <= 3


def test_max_tokens():
    r = finish_one(FakeRunner(), req("a", 5, max_tokens=6))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == expected_outputs(r.prompt_token_ids, 6)
    assert r.first_scheduled_time is not None and r.first_token_time is not None and r.finish_time is not None
    assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time


def test_model_max_length_stops():
    r = req("a", 5, max_tokens=100)
    r.output_token_ids = [7, 8, 9]
    assert check_stop(r, {EOS}, max_model_len=9) is None
    r.output_token_ids.append(10)
    assert check_stop(r, {EOS}, max_model_len=9) is FinishReason.LENGTH


def test_abort():
    runner = FakeRunner()
    sched = make(runner)
    a, b = req("a", 3, max_tokens=50), req("b", 3)
    for r in (a, b):
        sched.add(r)
    run_step(sched, runner)
    assert [r.request_id for r in sched.abort("a")] == ["a"]
    assert sched.abort("a") == [] and sched.abort("nope") == []
    assert a.finish_reason is FinishReason.ABORT
    assert used_blocks(sched) == sched.allocator.num_used  # only b's
    drain(sched, runner)
    assert sched.allocator.num_free == runner.num_kv_blocks


def test_abort_while_waiting():
    runner = FakeRunner()
    sched = make(runner, max_num_seqs=1)
    sched.add(req("a", 3))
    sched.add(req("b", 3))
    run_step(sched, runner)
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert [r.request_id for r in sched.abort("b")] == ["b"] and not sched.waiting


# ---- iteration-level scheduling --------------------------------------------------------------------


def test_step_order_decodes_then_prefill_chunks_then_new():
    runner = FakeRunner(num_kv_blocks=64, block_size=4)
    sched = make(runner, max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(req("d", 2, max_tokens=20))
    run_step(sched, runner)  # d: prompt done, decoding from now on
    sched.add(req("p", 25, max_tokens=2))  # needs 3 chunks of the 10-token budget
    run_step(sched, runner)  # d decode + 9 tokens of p
    sched.add(req("n", 3, max_tokens=2))
    step, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens, s.sample) for s in step.seqs] == [("d", 1, True), ("p", 9, False)]
    # p's last 7 tokens; n waits: 2 of its 3 would leave a chunk of one (MIN_PROMPT_CHUNK).
    step, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens, s.sample) for s in step.seqs] == [("d", 1, True), ("p", 7, True)]
    assert step.num_decode_tokens == 1 and step.num_prompt_tokens == 7
    step, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens, s.sample) for s in step.seqs] == [
        ("d", 1, True),
        ("p", 1, True),
        ("n", 3, True),
    ]


@pytest.mark.parametrize("budget", [3, 5, 8])  # 2: too small to split a prompt so (it falls back)
def test_no_prompt_runs_a_chunk_of_one_token(budget: int):
    """Every chunk of a prompt longer than one token has two tokens or more and leaves as many: a
    one-token chunk would run through the decode attention kernel instead of the prompt one."""
    runner = FakeRunner(num_kv_blocks=128, block_size=4)
    sched = make(runner, max_num_seqs=2, max_num_batched_tokens=budget)
    lengths = {f"r{i}": n for i, n in enumerate((2, 3, 5, 7, 9, 12))}
    for rid, n in lengths.items():
        sched.add(req(rid, n, max_tokens=3))
    drain(sched, runner)
    prompt_chunks = [
        s for step in runner.history for s in step if s.start_position + s.num_tokens <= lengths[s.request_id]
    ]
    assert sum(s.num_tokens for s in prompt_chunks) == sum(lengths.values())
    assert all(s.num_tokens >= 2 for s in prompt_chunks)


def test_chunked_prefill_does_not_stall_running_decodes():
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_model_len=512)
    sched = make(runner, max_num_seqs=4, max_num_batched_tokens=16)
    d = req("d", 4, max_tokens=30)
    sched.add(d)
    run_step(sched, runner)
    sched.add(req("long", 200, max_tokens=2))
    for _ in range(10):  # the long prompt takes 14 steps; d gets one token in every one of them
        before = d.num_output_tokens
        step, _ = run_step(sched, runner)
        assert d.num_output_tokens == before + 1 and step.num_tokens <= 16


def test_without_chunking_a_prompt_runs_whole_or_not_at_all():
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_model_len=512)
    sched = make(runner, max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=False)
    sched.add(req("a", 10, max_tokens=3))
    sched.add(req("b", 10, max_tokens=3))  # does not fit next to a's 10 tokens: waits
    step, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens) for s in step.seqs] == [("a", 10)]
    step, _ = run_step(sched, runner)
    assert [(s.request_id, s.num_tokens) for s in step.seqs] == [("a", 1), ("b", 10)]


def test_without_chunking_an_overlong_prompt_is_admitted_alone():
    runner = FakeRunner(num_kv_blocks=128, block_size=4, max_model_len=512)
    sched = make(runner, max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=False)
    sched.add(req("a", 4, max_tokens=3))
    run_step(sched, runner)
    sched.add(req("big", 40, max_tokens=2))
    sched.add(req("after", 2, max_tokens=2))  # FCFS: does not overtake big
    seen = []
    while sched.has_work():
        step, _ = run_step(sched, runner)
        seen.append([(s.request_id, s.num_tokens) for s in step.seqs])
    big = [i for i, s in enumerate(seen) if ("big", 40) in s]
    assert len(big) == 1 and seen[big[0]] == [("big", 40)]  # alone, whole
    assert all(rid != "after" for s in seen[: big[0]] for rid, _ in s)


def test_max_num_seqs_caps_the_batch():
    runner = FakeRunner(num_kv_blocks=64)
    sched = make(runner, max_num_seqs=2)
    for i in range(5):
        sched.add(req(f"r{i}", 3, max_tokens=3))
    step, _ = run_step(sched, runner)
    assert [s.request_id for s in step.seqs] == ["r0", "r1"] and len(sched.waiting) == 3


# ---- KV policies -----------------------------------------------------------------------------------


def test_lazy_preempts_the_most_recently_admitted_and_recomputes_exactly():
    # 6 blocks of 4 tokens; three requests of 7-token prompts take 2 blocks each, then need a third.
    runner = FakeRunner(num_kv_blocks=6, block_size=4, max_model_len=24)
    sched = make(runner, max_num_seqs=4, max_num_batched_tokens=32)
    reqs = [req(f"r{i}", 7, max_tokens=6) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_step(sched, runner)  # all three prompts: 7 tokens, 2 blocks each
    run_step(sched, runner)  # one decode each fills position 7: still 2 blocks
    assert sched.allocator.num_free == 0 and sched.num_preemptions == 0
    step, _ = run_step(sched, runner)  # r0 needs a third block: r2, the newest, is preempted
    assert [r.request_id for r in step.preempted] == ["r2"]
    assert reqs[2].status is RequestStatus.PREEMPTED and sched.waiting[0] is reqs[2]
    assert reqs[2].num_computed_tokens == 0 and reqs[2].block_ids == []
    assert [s.request_id for s in step.seqs] == ["r0", "r1"]
    emitted_before = reqs[2].num_output_tokens
    drain(sched, runner)
    assert sched.num_preemptions >= 1 and sched.allocator.num_free == 6
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r.prompt_token_ids, 6)
    assert reqs[2].num_output_tokens > emitted_before


def test_reserve_stops_at_the_first_request_that_does_not_fit():
    runner = FakeRunner(num_kv_blocks=10, block_size=4, max_model_len=40)
    sched = make(runner, max_num_seqs=8, kv_policy="reserve")
    a = req("a", 4, max_tokens=20)  # reserves 6 blocks
    b = req("b", 4, max_tokens=20)  # 6 more: does not fit
    c = req("c", 2, max_tokens=2)  # 1 block: would fit, but must not skip ahead of b
    for r in (a, b, c):
        sched.add(r)
    step, _ = run_step(sched, runner)
    assert [s.request_id for s in step.seqs] == ["a"]
    assert len(a.block_ids) == 6 and [r.request_id for r in sched.waiting] == ["b", "c"]
    drain(sched, runner)
    assert sched.num_preemptions == 0 and sched.allocator.num_free == 10


# ---- request-level batching ------------------------------------------------------------------------


def test_request_level_admits_nothing_while_its_batch_runs_and_returns_at_batch_end():
    runner = FakeRunner(num_kv_blocks=64)
    sched = make(runner, max_num_seqs=4, scheduling="request", kv_policy="reserve")
    short, long = req("short", 3, max_tokens=2), req("long", 3, max_tokens=8)
    sched.add(short)
    sched.add(long)
    step, out = run_step(sched, runner)
    assert [s.request_id for s in step.seqs] == ["short", "long"] and out == []  # nothing streamed
    late = req("late", 3, max_tokens=2)
    sched.add(late)
    released: list[str] = []
    while long.status is RequestStatus.RUNNING:
        step, out = run_step(sched, runner)
        assert "late" not in [s.request_id for s in step.seqs]
        released += [r.request_id for r in out]
        if short.is_finished and long.status is RequestStatus.RUNNING:
            assert "short" not in released  # finished, but held until the batch ends
    assert released == ["short", "long"]
    step, _ = run_step(sched, runner)
    assert [s.request_id for s in step.seqs] == ["late"]


# ---- random workloads ------------------------------------------------------------------------------


@dataclass
class Workload:
    arrivals: list[tuple[int, int, int]]  # (arrival step, prompt length, max_tokens)
    aborts: dict[int, list[int]] = field(default_factory=dict)  # step -> request indices
    # request index -> the output token whose text is the request's stop string
    stop_at: dict[int, int] = field(default_factory=dict)
    # request index -> its pooling: an embedding request (prefill only) instead of a generation
    pooling: dict[int, str] = field(default_factory=dict)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    arrivals = [
        (draw(st.integers(0, 30)), draw(st.integers(1, 24)), draw(st.integers(1, 16))) for _ in range(n)
    ]
    arrivals.sort(key=lambda a: a[0])
    aborts: dict[int, list[int]] = {}
    for i in draw(st.lists(st.integers(0, n - 1), max_size=3)):
        aborts.setdefault(draw(st.integers(0, 60)), []).append(i)
    stop_at = {i: draw(st.integers(1, 16)) for i in draw(st.lists(st.integers(0, n - 1), max_size=3))}
    methods = st.sampled_from(["last", "mean", "cls"])
    pooling = {i: draw(methods) for i in draw(st.lists(st.integers(0, n - 1), max_size=3))}
    return Workload(arrivals, aborts, {i: k for i, k in stop_at.items() if i not in pooling}, pooling)


def stop_point(tokens: Sequence[int], stop: str) -> int | None:
    """Reference: after how many of `tokens` the decoded text first holds `stop`."""
    text = ""
    for i, t in enumerate(tokens):
        text += DETOK.text(t)
        if stop in text:
            return i + 1
    return None


def over_random_workloads(test: Callable[..., None]) -> Callable[..., None]:
    """A property test over random workloads (`wl`), scheduler configs, block sizes and a few blocks
    past the longest request (`extra_blocks`: preemption is common)."""
    return settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(
            wl=workloads(),
            config=scheduler_configs(max_extra_budget=30),
            block_size=st.sampled_from([1, 2, 4]),
            extra_blocks=st.integers(0, 12),
        )(test)
    )


@over_random_workloads
def test_random_workloads_keep_every_invariant(wl, config, block_size, extra_blocks):
    longest = max(p + m for _, p, m in wl.arrivals)
    runner = cramped_runner(longest, block_size, extra_blocks)
    sched = make(runner, config)
    max_num_seqs, budget, chunked = config.max_num_seqs, config.max_num_batched_tokens, config.chunked_prefill
    scheduling, kv_policy = config.scheduling, config.kv_policy
    # A stop string: the text of the stop_at-th token the fake model says for that prompt.
    stops = {
        i: DETOK.text(expected_outputs(prompt_of(f"r{i}", wl.arrivals[i][1]), k)[-1])
        for i, k in wl.stop_at.items()
    }
    reqs = [
        embedding_req(f"r{i}", p, wl.pooling[i])
        if i in wl.pooling
        else req(f"r{i}", p, max_tokens=m, stop=(stops[i],) if i in stops else ())
        for i, (_, p, m) in enumerate(wl.arrivals)
    ]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    admitted: list[int] = []  # request indices in order of first admission
    released: list[Request] = []
    step_no = 0
    pending = list(zip(wl.arrivals, reqs, strict=True))
    while pending or sched.has_work():
        while pending and pending[0][0][0] <= step_no:
            sched.add(pending.pop(0)[1])
        for i in wl.aborts.get(step_no, []):
            released += sched.abort(reqs[i].request_id)
        was_running = {id(r) for r in sched.running}
        batch_before = [r for r in sched.running]
        step = sched.schedule()
        released += step.released
        # budgets
        assert step.num_seqs <= max_num_seqs and len(sched.running) <= max_num_seqs
        assert step.num_tokens <= budget or (not chunked and step.num_seqs == 1)
        assert sched.allocator.num_used == used_blocks(sched) <= runner.num_kv_blocks
        if kv_policy == "reserve":
            assert not step.preempted
        # lazy preempts the newest running requests first: victims are a suffix of the admission order
        if step.preempted:
            assert not {id(r) for r in step.requests} & {id(r) for r in step.preempted}
            order = [r for r in batch_before if r in step.preempted]
            assert order == batch_before[len(batch_before) - len(order) :]
        # FCFS: first admissions follow arrival order
        for r in sched.running:
            if id(r) not in was_running and index[r.request_id] not in admitted:
                admitted.append(index[r.request_id])
        # request-level batching admits nothing while earlier members still run
        if scheduling == "request":
            newly = [r for r in sched.running if id(r) not in was_running]
            still = [r for r in batch_before if r.status is RequestStatus.RUNNING]
            assert not (newly and still)
        if step.seqs:
            out = sched.update(step, runner.step(step.seqs))
            if scheduling == "request":  # nothing is streamed: only whole batches come back
                assert all(r.is_finished for r in out)
            released += [r for r in out if r.is_finished]
        step_no += 1
        assert step_no < 5000, "no progress"
    assert admitted == sorted(admitted)
    # no leaks: every block back, every request handed back exactly once
    assert sched.allocator.num_free == runner.num_kv_blocks and not sched.requests and not sched.running
    assert sorted(r.request_id for r in released) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert r.is_finished
        if r.pooling is not None:  # an embedding: no output, its whole prompt pooled (unless aborted)
            assert r.output_token_ids == [] and r.status is not RequestStatus.FINISHED_ERROR
            if r.status is RequestStatus.FINISHED_STOPPED:
                assert r.embedding == pytest.approx(pooled(runner, r.prompt_token_ids, r.pooling), rel=1e-9)
            continue
        want = expected_outputs(r.prompt_token_ids, r.num_output_tokens)
        assert r.output_token_ids == want  # the fake model's sequence, preempted or not
        # A stop string ends its request at the token that completes it (the fake model never says EOS).
        stop = r.sampling.stop[0] if r.sampling.stop else None
        at = (
            None
            if stop is None
            else stop_point(expected_outputs(r.prompt_token_ids, r.sampling.max_tokens), stop)
        )
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling.max_tokens and at is None
        if r.status is RequestStatus.FINISHED_STOPPED:
            assert r.num_output_tokens == at
        assert r.status is not RequestStatus.FINISHED_ERROR


def test_update_rejects_a_mismatched_runner_result():
    runner = FakeRunner()
    sched = make(runner)
    sched.add(req("a", 3))
    step = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(step, [])
    with pytest.raises(ValueError):
        sched.update(step, [None])
    assert sched.requests["a"].num_computed_tokens == 0  # nothing applied
    out = sched.update(step, [SampledToken(5)])
    assert out[0].output_token_ids == [5]
