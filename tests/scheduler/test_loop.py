"""IterationLoop (scheduler.loop) with the fake runner: streaming, aborts, failures, the worker thread.

Order of events and step counters only; the timeouts below are guards against a hang, not assertions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import pytest
from fakes import greedy_through_loop
from waiting import wait_until

from engine.contract import FatalRunnerError, SamplingParams, ScheduledSequence
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeDetokenizer, FakeRunner, hash_next_token
from scheduler.loop import IterationLoop, LoopStoppedError, new_step_thread
from scheduler.outputs import FinishReason, RequestDelta, StepReport

# The loop's tests hold with overlapped scheduling on and off.
pytestmark = pytest.mark.usefixtures("both_overlap_modes")

GUARD_S = 20  # a hang fails the test instead of stalling the suite


def expected_outputs(prompt, n):
    context = list(prompt)
    for _ in range(n):
        context.append(hash_next_token(context))
    return context[len(prompt) :]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [100 + (seed * 31 + i * 7) % 500 for i in range(n)]


async def collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    async def run():
        return [d async for d in stream]

    return await asyncio.wait_for(run(), GUARD_S)


async def in_thread_wait(event: threading.Event) -> None:
    assert await asyncio.wait_for(asyncio.to_thread(event.wait, GUARD_S), GUARD_S)


async def test_streams_one_delta_per_token_in_order(make_engine):
    engine = await make_engine()
    p = prompt(9)
    deltas = []
    async for d in engine.generate(p, SamplingParams(max_tokens=6), "a"):
        deltas.append(d)
        await asyncio.sleep(0)
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == expected_outputs(p, 6)
    assert [d.num_output_tokens for d in deltas][-1] == 6 and all(d.num_prompt_tokens == 9 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FinishReason.LENGTH]
    assert len(deltas) > 1  # streamed, not returned at the end
    assert engine.stats().running == 0 and engine.stats().kv_blocks_used == 0


async def test_lagging_consumer_gets_coalesced_deltas_without_loss(make_engine):
    engine = await make_engine()
    p = prompt(5)
    stream = engine.generate(p, SamplingParams(max_tokens=8, logprobs=1), "a")
    await wait_until(lambda: engine.stats().num_steps >= 8)  # finished before we read anything
    deltas = await collect(stream)
    assert len(deltas) == 1 and deltas[0].token_ids == expected_outputs(p, 8)
    assert deltas[0].finish_reason is FinishReason.LENGTH
    assert (
        deltas[0].logprobs is not None and [lp.token_id for lp in deltas[0].logprobs] == deltas[0].token_ids
    )


async def test_many_concurrent_requests_with_preemption_lose_and_repeat_nothing(make_engine):
    # 10 blocks of 4 tokens for 6 requests of up to 30 tokens: lazy allocation must preempt.
    engine = await make_engine(FakeRunner(num_kv_blocks=10, block_size=4, max_model_len=40), max_num_seqs=6)
    specs = [(f"r{i}", prompt(6 + i, seed=i), 12 + i) for i in range(6)]
    streams = [engine.generate(p, SamplingParams(max_tokens=m), rid) for rid, p, m in specs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for (_, p, m), deltas in zip(specs, results, strict=True):
        assert [t for d in deltas for t in d.token_ids] == expected_outputs(p, m)
        assert deltas[-1].finish_reason is FinishReason.LENGTH
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0


async def test_generate_rejects_bad_requests_at_once(make_engine):
    engine = await make_engine(FakeRunner(max_model_len=32))
    with pytest.raises(ValueError):
        engine.generate([], SamplingParams(), "a")
    with pytest.raises(ValueError):
        engine.generate(prompt(30), SamplingParams(max_tokens=3), "a")
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([5, 49152], SamplingParams(), "a")  # would fail every request in its step
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([5], SamplingParams(logit_bias={-1: 1.0}), "a")
    stream = engine.generate(prompt(3), SamplingParams(max_tokens=3), "a")
    with pytest.raises(ValueError):
        engine.generate(prompt(3), SamplingParams(), "a")
    await collect(stream)
    assert engine.max_model_len == 32


async def test_abort_frees_blocks_before_the_next_step(make_engine, both_overlap_modes):
    """Without overlap the step after the abort no longer has the request; with overlap, that step
    was scheduled before the abort (it may run the request's row for nothing), and the one after it
    no longer has the request."""
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    engine = await make_engine(runner)
    seen: list[tuple[set[str], int, int]] = []  # per step: request ids, blocks used, blocks in batch
    inner = runner.step

    def step(batch):
        seen.append(
            (
                {s.request_id for s in batch},
                engine.stats().kv_blocks_used,
                sum(len(s.block_table) for s in batch),
            )
        )
        return inner(batch)

    runner.step = step  # type: ignore[method-assign]
    a = engine.generate(prompt(10), SamplingParams(max_tokens=50), "a")
    b = engine.generate(prompt(10, seed=1), SamplingParams(max_tokens=5), "b")
    await in_thread_wait(runner.step_started)  # the first step (both prompts) is in flight
    engine.abort("a")  # mid-step: applied only once the step is over
    gate.set()
    deltas_a = await collect(a)
    await collect(b)
    assert deltas_a[-1].finish_reason is FinishReason.ABORT
    assert seen[0][0] == {"a", "b"}
    # From the next step on (overlapped: the one after), a is gone and only b's blocks are in use.
    if both_overlap_modes:
        assert all(ids == {"b"} for ids, _, _ in seen[2:])
    else:
        for ids, used, in_batch in seen[1:]:
            assert ids == {"b"} and used == in_batch
    assert engine.stats().kv_blocks_used == 0


async def test_abort_from_another_thread_and_unknown_ids(make_engine):
    engine = await make_engine()
    stream = engine.generate(prompt(4), SamplingParams(max_tokens=10_000 // 100), "a")
    first = await asyncio.wait_for(stream.__anext__(), GUARD_S)
    t = threading.Thread(target=engine.abort, args=("a",))
    t.start()
    t.join()
    engine.abort("a")  # idempotent
    engine.abort("never-seen")
    rest = await collect(stream)
    assert first.finish_reason is None and rest[-1].finish_reason is FinishReason.ABORT
    assert engine.stats().kv_blocks_used == 0 and engine.is_running


async def test_closing_the_iterator_aborts(make_engine):
    engine = await make_engine()
    stream = engine.generate(prompt(4), SamplingParams(max_tokens=100), "a")
    await asyncio.wait_for(stream.__anext__(), GUARD_S)
    await stream.aclose()
    await wait_until(lambda: engine.stats().running == 0)
    assert engine.stats().kv_blocks_used == 0


async def test_cancelling_the_consumer_task_aborts(make_engine):
    engine = await make_engine()
    stream = engine.generate(prompt(4), SamplingParams(max_tokens=100), "a")
    got_one = asyncio.Event()

    async def consume():
        async for _ in stream:
            got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), GUARD_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.stats().running == 0)
    assert engine.stats().kv_blocks_used == 0
    # the id is free again once the request is gone
    await collect(engine.generate(prompt(4), SamplingParams(max_tokens=2), "a"))


async def held_first_step(make_engine, max_tokens: int) -> tuple[IterationLoop, FakeRunner, AsyncIterator]:
    """An engine running request "a", its first step held in the worker thread until runner.gate is set."""
    runner = FakeRunner(gate=threading.Event())
    engine = await make_engine(runner)
    stream = engine.generate(prompt(4), SamplingParams(max_tokens=max_tokens), "a")
    await in_thread_wait(runner.step_started)
    return engine, runner, stream


async def test_event_loop_keeps_answering_during_a_slow_step(make_engine):
    engine, runner, stream = await held_first_step(make_engine, max_tokens=2)
    progress = 0
    for _ in range(50):  # another coroutine runs many turns while the step is held in the worker
        await asyncio.sleep(0)
        progress += 1
    assert progress == 50 and runner.num_steps == 0 and engine.stats().running == 1
    runner.gate.set()
    deltas = await collect(stream)
    assert deltas[-1].finish_reason is FinishReason.LENGTH


async def test_idle_loop_does_not_step(make_engine):
    runner = FakeRunner()
    engine = await make_engine(runner)
    await wait_until(lambda: engine.is_idle)  # parked: nothing runs until a request wakes it
    assert engine.stats().num_steps == 0 and runner.num_steps == 0 and engine.is_running
    await collect(engine.generate(prompt(4), SamplingParams(max_tokens=3), "a"))
    await wait_until(lambda: engine.is_idle)
    steps = engine.stats().num_steps
    assert steps == runner.num_steps and 3 <= steps
    assert engine.is_idle and engine.stats().num_steps == steps


async def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(make_engine):
    runner = FakeRunner(fail_when=lambda batch: any(s.request_id == "bad" for s in batch))
    engine = await make_engine(runner)
    deltas = await collect(engine.generate(prompt(4), SamplingParams(max_tokens=5), "bad"))
    assert deltas[-1].finish_reason is FinishReason.ERROR and "injected step failure" in (
        deltas[-1].error or ""
    )
    assert engine.is_running and engine.stats().kv_blocks_used == 0
    good = await collect(engine.generate(prompt(4), SamplingParams(max_tokens=5), "good"))
    assert [t for d in good for t in d.token_ids] == expected_outputs(prompt(4), 5)


async def test_a_dead_loop_fails_every_request_and_refuses_new_ones(make_engine):
    engine, runner, a = await held_first_step(make_engine, max_tokens=50)
    b = engine.generate(prompt(4), SamplingParams(max_tokens=50), "b")  # waiting

    def broken_update(step, sampled):
        raise AssertionError("scheduler bug")

    engine._scheduler.update = broken_update  # type: ignore[method-assign]
    engine._scheduler.fail = broken_update  # type: ignore[method-assign]
    runner.gate.set()
    for stream in (a, b):
        deltas = await collect(stream)
        assert deltas[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in (deltas[-1].error or "")
    assert not engine.is_running
    with pytest.raises(LoopStoppedError):
        engine.generate(prompt(4), SamplingParams(), "c")


# ---- text and stop strings --------------------------------------------------------------------------

WORDS = FakeDetokenizer({30: "one", 31: " two", 32: " <", 33: "/e", 34: ">", 35: " three"})


async def start_with_text(runner: FakeRunner) -> IterationLoop:
    engine = IterationLoop(runner, detokenizer=WORDS)
    await engine.start()
    return engine


def finished_event(engine: IterationLoop, request_id: str) -> tuple[asyncio.Event, list[StepReport]]:
    """Set by the step report that lists the request as finished; every report, in order."""
    reports: list[StepReport] = []
    done = asyncio.Event()

    def on_step(report: StepReport) -> None:
        reports.append(report)
        if request_id in report.finished_ids:
            done.set()

    engine.add_step_listener(on_step)
    return done, reports


async def test_a_stop_string_frees_the_request_in_the_iteration_that_produced_it(both_overlap_modes):
    runner = FakeRunner(script=[30, 31, 32, 33, 34, 35, 35, 35])
    engine = await start_with_text(runner)
    try:
        done, reports = finished_event(engine, "a")
        stream = engine.generate(prompt(6), SamplingParams(max_tokens=50, stop=(" </e>",)), "a")
        await asyncio.wait_for(done.wait(), GUARD_S)
        # The 5th token completes the stop string: the step that sampled it (the 5th; the prompt's
        # step sampled the first) finished the request and its report already sees its blocks free.
        last = next(r for r in reports if r.finished_ids)
        assert (last.step, last.finished_ids, last.kv_blocks_used) == (5, ["a"], 0)
        if both_overlap_modes:  # the step after it was scheduled before: it may run one row for nothing
            assert reports[-1].step <= 6 and runner.num_steps <= 6
        else:
            assert sum("a" in r.request_ids for r in reports) == 5 == runner.num_steps  # no step after it
        deltas = await collect(stream)
        assert "".join(d.text for d in deltas) == "one two"
        assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].num_output_tokens == 5
        assert deltas[-1].stop_string == " </e>"  # which one, as vLLM's stop_reason says
    finally:
        await asyncio.wait_for(engine.shutdown(), GUARD_S)


async def test_a_lagging_consumer_gets_the_text_and_logprobs_of_every_delta_merged():
    params = SamplingParams(max_tokens=50, logprobs=1, stop=(" </e>",))
    script = [30, 31, 32, 33, 35, 32, 33, 34]  # " </e" is held twice; the second one completes
    engine = await start_with_text(FakeRunner(script=script))
    try:
        streamed = []
        async for d in engine.generate(prompt(6), params, "reader"):
            streamed.append(d)
            await asyncio.sleep(0)  # read each delta before the next step's
        done, _ = finished_event(engine, "lagging")
        stream = engine.generate(prompt(6), params, "lagging")
        await asyncio.wait_for(done.wait(), GUARD_S)  # finished before anything is read
        (merged,) = await collect(stream)
    finally:
        await asyncio.wait_for(engine.shutdown(), GUARD_S)
    assert len(streamed) > 1
    assert merged.text == "".join(d.text for d in streamed) == "one two </e three"
    entries = [(lp.token_id, lp.text_offset) for lp in merged.logprobs or []]
    assert entries == [(lp.token_id, lp.text_offset) for d in streamed for lp in d.logprobs or []]
    assert entries == [(30, 0), (31, 3), (32, 7), (33, 9), (35, 11)]  # not the stop string's tokens
    assert merged.token_ids == script and merged.finish_reason is FinishReason.STOP
    assert merged.stop_string == streamed[-1].stop_string == " </e>"


async def test_stop_strings_need_a_detokenizer(make_engine):
    engine = await make_engine()
    with pytest.raises(ValueError, match="detokenizer"):
        engine.generate(prompt(4), SamplingParams(stop=("x",)), "a")
    deltas = await collect(engine.generate(prompt(4), SamplingParams(max_tokens=3), "b"))
    assert all(d.text == "" for d in deltas) and deltas[-1].finish_reason is FinishReason.LENGTH


async def test_shutdown_aborts_everything_and_stops(make_engine):
    engine = await make_engine()
    a = engine.generate(prompt(4), SamplingParams(max_tokens=100), "a")
    await asyncio.wait_for(a.__anext__(), GUARD_S)
    b = engine.generate(prompt(4), SamplingParams(max_tokens=100), "b")
    await asyncio.wait_for(engine.shutdown(), GUARD_S)
    assert (await collect(a))[-1].finish_reason is FinishReason.ABORT
    assert (await collect(b))[-1].finish_reason is FinishReason.ABORT
    assert not engine.is_running and engine.stats().kv_blocks_used == 0
    with pytest.raises(LoopStoppedError):
        engine.generate(prompt(4), SamplingParams(), "c")


async def test_step_listener_sees_every_step(make_engine):
    engine = await make_engine(max_num_batched_tokens=64)
    reports: list[StepReport] = []
    engine.add_step_listener(reports.append)
    engine.add_step_listener(lambda r: 1 / 0)  # a broken listener does not stop the loop
    await collect(engine.generate(prompt(7), SamplingParams(max_tokens=4), "a"))
    assert len(reports) == engine.stats().num_steps == 4
    assert (reports[0].num_prompt_tokens, reports[0].num_decode_tokens, reports[0].num_seqs) == (7, 0, 1)
    assert all((r.num_tokens, r.num_decode_tokens) == (1, 1) for r in reports[1:])
    assert reports[-1].num_finished == 1 and not any(r.failed for r in reports)


async def test_request_level_batching_returns_early_finishers_with_their_batch(make_engine):
    engine = await make_engine(scheduling="request", kv_policy="reserve")
    done_at: dict[str, int] = {}  # engine step count when each request's last delta arrived

    async def run(rid, n):
        deltas = await collect(engine.generate(prompt(4, seed=n), SamplingParams(max_tokens=n), rid))
        done_at[rid] = engine.stats().num_steps
        return deltas

    short_deltas, long_deltas = await asyncio.gather(run("short", 2), run("long", 12))
    # one delta each with all its tokens; the short one comes back with the batch, not after 2 steps
    assert len(short_deltas) == 1 and len(short_deltas[0].token_ids) == 2
    assert len(long_deltas) == 1 and len(long_deltas[0].token_ids) == 12
    assert done_at == {"short": 12, "long": 12}


# --- the loop's queue time (RequestDelta.queue_time_s) -----------------------------------------------


async def test_queue_time_on_the_first_delta_only():
    engine = IterationLoop(FakeRunner(), SchedulerConfig(max_num_seqs=1))
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        streams = [engine.generate([5, 6, 7], params, f"r{i}") for i in range(2)]

        async def deltas(stream):
            return [d async for d in stream]

        first, second = await asyncio.wait_for(asyncio.gather(*map(deltas, streams)), 20)
        for ds in (first, second):
            assert ds[0].queue_time_s is not None and ds[0].queue_time_s >= 0
            assert all(d.queue_time_s is None for d in ds[1:])
        # max_num_seqs=1: the second request waited for the whole first one.
        assert second[0].queue_time_s >= first[0].queue_time_s
    finally:
        await engine.shutdown()


# --- pipelined: up to pipeline_depth batches in flight (ORCA) ------------------------------------------

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)


@pytest.mark.parametrize("num_kv_blocks", [64, 6], ids=["roomy", "preempting"])
async def test_pipelined_loop_keeps_depth_batches_in_flight(num_kv_blocks: int) -> None:
    """Same tokens as the plain loop, up to `depth` batches in flight, none sharing a request, and with
    a tight KV cache preemptions that never hit a request whose batch is still in the pipeline."""
    prompts = [[20 + i] * (3 + 5 * i) for i in range(6)]
    plain = await greedy_through_loop(
        FakeRunner(num_kv_blocks=num_kv_blocks, block_size=16), prompts, 8, SCHED
    )
    fake = FakeRunner(pipeline_depth=2, num_kv_blocks=num_kv_blocks, block_size=16)
    engine = IterationLoop(fake, SCHED)
    piped = await greedy_through_loop(fake, prompts, 8, SCHED, engine)
    assert piped == plain
    assert fake.max_in_flight == 2 and not fake.in_flight
    assert fake.max_batch_seen <= 3  # the 6 requests spread over the 2 batches in flight
    if num_kv_blocks == 6:
        assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_fatal_step_error_stops_the_loop(depth: int) -> None:
    """One failure path at every depth: the failed step is counted, its request gets the error, the
    loop stops and says so."""

    class DiesAtThirdStep(FakeRunner):
        def submit(self, batch: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
            if self.num_steps >= 2:
                raise FatalRunnerError("worker gone")
            return super().submit(batch)

    runner = DiesAtThirdStep(pipeline_depth=depth)
    engine = IterationLoop(runner, SCHED)
    await engine.start()
    deltas = [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=20), "r")]
    assert deltas[-1].error is not None and "worker gone" in deltas[-1].error
    await wait_until(lambda: not engine.is_running)
    assert engine.stats().num_steps == 3  # two that ran and the one that failed
    with pytest.raises(LoopStoppedError):
        engine.generate([5], SamplingParams(max_tokens=2), "late")
    await engine.shutdown()


async def test_steps_run_in_the_callers_thread_which_the_loop_leaves_running():
    """One thread builds the engine and runs every step (one OpenMP thread team; IterationLoop says why)."""
    seen: set[str] = set()

    class Recording(FakeRunner):
        def step(self, batch):
            seen.add(threading.current_thread().name)
            return super().step(batch)

    thread = new_step_thread()
    built_in = await asyncio.get_running_loop().run_in_executor(
        thread, lambda: threading.current_thread().name
    )
    engine = IterationLoop(Recording(), step_thread=thread)
    await engine.start()
    await collect(engine.generate(prompt(5), SamplingParams(max_tokens=3), "a"))
    await engine.shutdown()
    assert seen == {built_in}
    assert thread.submit(lambda: 1).result() == 1  # the caller's pool is still open
    thread.shutdown()
