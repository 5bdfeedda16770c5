"""Restarting a dead executor (scheduler.loop, the fake runner standing in for a parallel engine): the
requests whose KV cache went down fail, the waiting ones are served once it is back, restarts are
counted, and past the budget the loop gives up as before."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from waiting import wait_until

from engine.contract import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.loop import IterationLoop, LoopStoppedError, RestartBudget
from scheduler.outputs import FinishReason, RequestDelta

# The loop's tests hold with overlapped scheduling on and off.
pytestmark = pytest.mark.usefixtures("both_overlap_modes")

GUARD_S = 20


async def collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    async def run() -> list[RequestDelta]:
        return [d async for d in stream]

    return await asyncio.wait_for(run(), GUARD_S)


class GatedRestart(FakeRunner):
    """restart() waits on a gate, so a test can look at the loop while it restarts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(can_restart=True, **kwargs)
        self.restart_gate = threading.Event()
        self.restart_gate.set()

    def restart(self) -> None:
        assert self.restart_gate.wait(GUARD_S)
        super().restart()


@pytest.fixture
async def loops():
    made: list[IterationLoop] = []

    def make(runner: FakeRunner, **cfg) -> IterationLoop:
        engine = IterationLoop(runner, SchedulerConfig(**cfg))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.shutdown()


def test_restart_budget_counts_within_the_window() -> None:
    budget = RestartBudget(2, 10.0)
    assert budget.allows(0.0)
    budget.record(0.0)
    budget.record(5.0)
    assert not budget.allows(9.0)
    assert budget.allows(10.5)  # the first restart left the window
    assert not RestartBudget(0, 10.0).allows(0.0)


async def test_running_requests_fail_waiting_ones_are_served_after_the_restart(loops) -> None:
    runner = GatedRestart(num_kv_blocks=64, block_size=4, step_delay_s=0.002)
    engine = loops(runner, max_num_seqs=2, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    running = [engine.generate([5, 6, 7, i], params, f"run{i}") for i in range(2)]
    waiting = engine.generate([9, 9, 9], SamplingParams(max_tokens=5, ignore_eos=True), "wait")
    tasks = [asyncio.ensure_future(collect(s)) for s in [*running, waiting]]
    await wait_until(lambda: engine.stats().num_steps >= 3)
    assert engine.stats().waiting == 1
    runner.restart_gate.clear()
    runner.kill()
    await wait_until(lambda: engine.is_restarting)
    assert not engine.is_running
    # Requests arriving during the restart queue up instead of being refused.
    late = asyncio.ensure_future(
        collect(engine.generate([4, 4], SamplingParams(max_tokens=3, ignore_eos=True), "late"))
    )
    runner.restart_gate.set()
    results = await asyncio.gather(*tasks, late)
    for deltas in results[:2]:
        assert deltas[-1].finish_reason is FinishReason.ERROR and "exited" in (deltas[-1].error or "")
    for deltas, n in ((results[2], 5), (results[3], 3)):
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(d.token_ids) for d in deltas) == n
    assert runner.num_restarts == 1 and engine.stats().num_restarts == 1
    assert engine.is_running and not engine.is_restarting
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0


async def test_a_worker_dying_while_idle_is_restarted_before_the_next_request(loops) -> None:
    runner = FakeRunner(can_restart=True)
    engine = loops(runner)
    await engine.start()
    runner.kill()
    await wait_until(lambda: runner.num_restarts == 1)  # IDLE_WATCH_S polls
    deltas = await collect(engine.generate([1, 2, 3], SamplingParams(max_tokens=3), "r"))
    assert deltas[-1].finish_reason is FinishReason.LENGTH


async def test_past_the_budget_the_loop_gives_up(loops) -> None:
    runner = FakeRunner(can_restart=True, step_delay_s=0.002)
    engine = loops(runner, max_worker_restarts=1, worker_restart_window_s=600)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for attempt in range(2):
        stream = engine.generate([3, 4, 5], params, f"r{attempt}")
        task = asyncio.ensure_future(collect(stream))
        await wait_until(lambda: engine.stats().running == 1)
        runner.kill()
        deltas = await task
        assert deltas[-1].finish_reason is FinishReason.ERROR
    await wait_until(lambda: not engine.is_running and not engine.is_restarting)
    assert runner.num_restarts == 1
    with pytest.raises(LoopStoppedError):
        engine.generate([1], SamplingParams(max_tokens=2), "late")


async def test_a_failed_restart_ends_the_loop_and_every_queued_request(loops) -> None:
    runner = FakeRunner(can_restart=True, step_delay_s=0.002)
    runner.fail_restart = True
    engine = loops(runner, max_num_seqs=1)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    first = asyncio.ensure_future(collect(engine.generate([3, 4, 5], params, "a")))
    queued = asyncio.ensure_future(collect(engine.generate([6, 7], params, "b")))
    await wait_until(lambda: engine.stats().running == 1)
    runner.kill()
    for deltas in await asyncio.gather(first, queued):
        assert deltas[-1].finish_reason is FinishReason.ERROR
    assert not engine.is_running
    with pytest.raises(LoopStoppedError):
        engine.generate([1], SamplingParams(max_tokens=2), "late")


async def test_an_executor_that_cannot_restart_stops_the_loop(loops) -> None:
    runner = FakeRunner(step_delay_s=0.002)
    engine = loops(runner)
    task = asyncio.ensure_future(
        collect(engine.generate([3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True), "a"))
    )
    await wait_until(lambda: engine.stats().running == 1)
    runner.kill("worker orca-rank1 (pid 1) exited with code -9")
    deltas = await task
    assert deltas[-1].finish_reason is FinishReason.ERROR and "orca-rank1" in (deltas[-1].error or "")
    await wait_until(lambda: not engine.is_running)
    with pytest.raises(LoopStoppedError, match="exited"):
        engine.generate([1], SamplingParams(max_tokens=2), "late")


async def test_pipelined_batches_in_flight_all_fail_and_the_loop_restarts(loops) -> None:
    runner = FakeRunner(can_restart=True, pipeline_depth=2, step_delay_s=0.002)
    engine = loops(runner, max_num_seqs=4)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    tasks = [asyncio.ensure_future(collect(engine.generate([i + 1, 2], params, f"r{i}"))) for i in range(4)]
    await wait_until(lambda: engine.stats().running == 4 and engine.stats().num_steps >= 4)
    runner.kill()
    for deltas in await asyncio.gather(*tasks):
        assert deltas[-1].finish_reason is FinishReason.ERROR
    await wait_until(lambda: engine.is_running)
    deltas = await collect(engine.generate([8, 8], SamplingParams(max_tokens=4, ignore_eos=True), "after"))
    assert deltas[-1].finish_reason is FinishReason.LENGTH and engine.stats().num_restarts == 1


async def test_cached_prefixes_are_forgotten_with_the_cache_they_were_in(loops) -> None:
    """A prompt seen before the restart is computed again after it: the fake runner's simulated cache
    is empty after restart(), so a prefix served from a stale block would fail the step."""
    runner = FakeRunner(can_restart=True, num_kv_blocks=64, block_size=4)
    engine = loops(runner, enable_prefix_caching=True)
    prompt = list(range(100, 130))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    before = await collect(engine.generate(prompt, params, "before"))
    assert engine.stats().prefix_cache.queries > 0
    runner.kill()
    await wait_until(lambda: runner.num_restarts == 1)
    after = await collect(engine.generate(prompt, params, "after"))
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in after for t in d.token_ids] == [t for d in before for t in d.token_ids]


async def test_a_prompt_that_is_scored_never_comes_from_the_prefix_cache(loops) -> None:
    runner = FakeRunner(num_kv_blocks=64, block_size=4)
    engine = loops(runner, enable_prefix_caching=True)
    prompt = list(range(100, 130))
    await collect(engine.generate(prompt, SamplingParams(max_tokens=2), "warm"))
    hits = engine.stats().prefix_cache.hits
    deltas = await collect(engine.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), "scored"))
    assert engine.stats().prefix_cache.hits == hits
    scored = deltas[0].prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(prompt)
    assert [lp.token_id for lp in scored[1:] if lp is not None] == prompt[1:]
