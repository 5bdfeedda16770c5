"""StepReport's per-request detail (what the live iteration view draws): the batch in order with each
request's tokens, start position and kind, and who was admitted, preempted and finished at which step."""

from __future__ import annotations

import asyncio

import pytest

from engine.contract import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.loop import IterationLoop
from scheduler.outputs import FinishReason, StepReport

# The loop's tests hold with overlapped scheduling on and off.
pytestmark = pytest.mark.usefixtures("both_overlap_modes")

GUARD_S = 20  # a hang fails the test instead of stalling the suite


def prompt(n: int, seed: int = 0) -> list[int]:
    return [100 + (seed * 31 + i * 7) % 500 for i in range(n)]


async def run_engine(runner: FakeRunner, requests, **config) -> tuple[list[StepReport], dict]:
    """Run requests [(id, prompt, max_tokens, start after this many steps)] to their end."""
    engine = IterationLoop(runner, SchedulerConfig(**config))
    reports: list[StepReport] = []
    # Set on the loop thread by the listener the moment the n-th report arrives (an event, not a
    # poll: a poll could let the engine run several more steps before the request arrives).
    reached = {after: asyncio.Event() for *_, after in requests}

    def on_step(report: StepReport) -> None:
        reports.append(report)
        for n, event in reached.items():
            if len(reports) >= n:
                event.set()

    engine.add_step_listener(on_step)
    await engine.start()

    async def one(rid, ids, max_tokens, after):
        if after:
            await reached[after].wait()
        return rid, [d async for d in engine.generate(ids, SamplingParams(max_tokens=max_tokens), rid)]

    try:
        done = await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), GUARD_S)
    finally:
        await engine.shutdown()
    return reports, dict(done)


def batch(report: StepReport) -> list[tuple[str, int, int, bool]]:
    return list(
        zip(
            report.request_ids,
            report.request_num_tokens,
            report.request_start_positions,
            report.request_is_decode,
            strict=True,
        )
    )


async def test_a_request_joins_the_running_batch_and_leaves_it_the_step_it_finishes(both_overlap_modes):
    runner = FakeRunner(num_kv_blocks=64, block_size=4)
    # "a": a 12-token prompt in chunks of 8, then decodes; "b" arrives once "a" is decoding (and "a"
    # still is when "b" joins: with overlapped scheduling the loop has scheduled a step ahead).
    reports, _ = await run_engine(
        runner,
        [("a", prompt(12), 8, 0), ("b", prompt(3, seed=1), 2, 3)],
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    assert [r.step for r in reports] == list(range(1, len(reports) + 1))
    assert batch(reports[0]) == [("a", 8, 0, False)]  # admitted: a prompt chunk from position 0
    assert batch(reports[1]) == [("a", 4, 8, False)]  # the rest of the prompt (samples a token)
    assert batch(reports[2]) == [("a", 1, 12, True)]
    joined = next(k for k, r in enumerate(reports) if "b" in r.request_ids)
    assert batch(reports[joined]) == [("a", 1, 12 + joined - 2, True), ("b", 3, 0, False)]
    assert batch(reports[joined + 1])[1] == ("b", 1, 3, True)
    # Each leaves at the step that sampled its last token, and is not in the batch after it.
    for rid in ("a", "b"):
        (last,) = [k for k, r in enumerate(reports) if rid in r.finished_ids]
        assert rid in reports[last].request_ids and all(rid not in r.request_ids for r in reports[last + 1 :])
    assert all(r.kv_blocks_total == 64 and r.preempted_ids == [] for r in reports)
    # 8 tokens in blocks of 4; overlapped, the next chunk (4 tokens) was scheduled before the report.
    assert reports[-1].kv_blocks_used == 0 and reports[0].kv_blocks_used == (3 if both_overlap_modes else 2)


async def test_preempted_requests_are_named_and_recompute_from_position_zero():
    # 10 blocks of 4 tokens for 6 requests of up to 30 tokens: lazy allocation must preempt.
    runner = FakeRunner(num_kv_blocks=10, block_size=4, max_model_len=40)
    requests = [(f"r{i}", prompt(6 + i, seed=i), 12 + i, 0) for i in range(6)]
    reports, _ = await run_engine(runner, requests, max_num_seqs=6)
    preempting = [r for r in reports if r.preempted_ids]
    assert preempting and all(r.num_preempted == len(r.preempted_ids) for r in reports)
    victim = preempting[0].preempted_ids[0]
    assert victim not in preempting[0].request_ids
    again = next(r for r in reports if r.step > preempting[0].step and victim in r.request_ids)
    i = again.request_ids.index(victim)
    assert again.request_start_positions[i] == 0 and not again.request_is_decode[i]
    assert sorted(i for r in reports for i in r.finished_ids) == sorted(rid for rid, *_ in requests)
    assert any(r.num_waiting > 0 for r in reports)


async def test_a_failed_step_reports_its_requests_finished():
    runner = FakeRunner(fail_when=lambda seqs: any(s.start_position == 5 for s in seqs))
    reports, done = await run_engine(runner, [("a", prompt(4), 8, 0)])
    assert done["a"][-1].finish_reason is FinishReason.ERROR
    assert reports[-1].failed and reports[-1].finished_ids == ["a"] and reports[-1].request_ids == ["a"]
