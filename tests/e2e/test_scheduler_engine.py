"""IterationLoop over the real engine (LocalExecutor) on a tiny random Llama: ORCA's behaviours
end to end. Order of events and step counters only, never wall-clock time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from builders import cpu_engine_config

from engine.contract import SamplingParams
from engine.executor import LocalExecutor
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from scheduler.outputs import FinishReason, RequestDelta, StepReport

GUARD_S = 120  # a hang fails the test instead of stalling the suite


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(n: int, seed: int) -> list[int]:
    return [20 + (seed * 977 + i * 131) % 40000 for i in range(n)]


def runner_for(model_dir: Path, num_kv_blocks: int, block_size: int = 4) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(model_dir, block_size=block_size, num_kv_blocks=num_kv_blocks))


@pytest.fixture(scope="module")
def roomy_runner(tiny_llama_dir: Path) -> LocalExecutor:
    return runner_for(tiny_llama_dir, num_kv_blocks=256)


async def collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    async def run():
        return [d async for d in stream]

    return await asyncio.wait_for(run(), GUARD_S)


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def run_engine(
    runner: LocalExecutor, config: SchedulerConfig, specs
) -> tuple[list[list[int]], IterationLoop]:
    engine = IterationLoop(runner, config)
    await engine.start()
    try:
        streams = [engine.generate(p, params, rid) for rid, p, params in specs]
        results = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    for deltas in results:
        assert deltas[-1].finish_reason is FinishReason.LENGTH, deltas[-1].error
    return [tokens(d) for d in results], engine


async def test_preempted_request_recomputes_the_same_tokens(
    tiny_llama_dir: Path, roomy_runner: LocalExecutor
):
    specs = [(f"r{i}", prompt(9 + 3 * i, seed=i), greedy(20)) for i in range(4)]
    # Reference: each request alone, plenty of KV cache, no preemption.
    alone = []
    for spec in specs:
        out, engine = await run_engine(roomy_runner, SchedulerConfig(), [spec])
        assert engine.stats().num_preemptions == 0
        alone += out
    # Together in 14 blocks of 4 tokens (56 slots for ~130 tokens): lazy allocation must preempt.
    tight = runner_for(tiny_llama_dir, num_kv_blocks=14)
    together, engine = await run_engine(tight, SchedulerConfig(max_num_seqs=4), specs)
    assert engine.stats().num_preemptions > 0
    assert together == alone


async def test_late_arrival_gets_its_first_token_before_the_running_one_finishes(
    roomy_runner: LocalExecutor,
):
    engine = IterationLoop(roomy_runner, SchedulerConfig())
    await engine.start()
    events: list[tuple[str, int, FinishReason | None]] = []  # (request, its output count, finish)

    async def consume(rid: str, stream: AsyncIterator[RequestDelta]) -> None:
        async for d in stream:
            events.append((rid, d.num_output_tokens, d.finish_reason))

    try:
        long = engine.generate(prompt(12, seed=1), greedy(24), "long")
        first = await asyncio.wait_for(long.__anext__(), GUARD_S)
        events.append(("long", first.num_output_tokens, first.finish_reason))
        long_task = asyncio.create_task(consume("long", long))
        await consume("short", engine.generate(prompt(10, seed=2), greedy(3), "short"))
        await asyncio.wait_for(long_task, GUARD_S)
    finally:
        await engine.shutdown()
    first_short = next(i for i, e in enumerate(events) if e[0] == "short")
    short_done = next(i for i, e in enumerate(events) if e[0] == "short" and e[2] is not None)
    long_done = next(i for i, e in enumerate(events) if e[0] == "long" and e[2] is not None)
    # The newcomer joined at an iteration boundary: its first token and its end both come while the
    # long request is still generating, and the long one did not pause for it.
    assert first_short < short_done < long_done
    long_before = [e[1] for e in events[:short_done] if e[0] == "long"]
    assert long_before and max(long_before) < 24
    assert events[long_done][1] == 24 and events[short_done][2] is FinishReason.LENGTH


async def test_early_finisher_returns_while_the_long_one_keeps_running(roomy_runner: LocalExecutor):
    # One token per step, to count steps: speculative decoding (which the tiny model's loops feed) off.
    engine = IterationLoop(roomy_runner, SchedulerConfig(speculative="off"))
    await engine.start()
    done_at: dict[str, int] = {}  # engine steps when the request's last delta arrived
    finished_in: dict[str, int] = {}  # the step that ended each request, from the loop's reports

    def on_step(report: StepReport) -> None:
        finished_in.update(dict.fromkeys(report.finished_ids, report.step))

    engine.add_step_listener(on_step)

    async def run(rid: str, p: list[int], n: int) -> list[int]:
        deltas = await collect(engine.generate(p, greedy(n), rid))
        done_at[rid] = engine.stats().num_steps
        return tokens(deltas)

    try:
        short, long = await asyncio.gather(run("short", prompt(8, 3), 3), run("long", prompt(8, 4), 20))
    finally:
        await engine.shutdown()
    assert len(short) == 3 and len(long) == 20
    # Both prompts ran in step 1; short's 3rd token came in step 3, long's 20th in step 20; short's
    # caller had its answer while long was still running (a loaded machine may let the loop run a
    # step or two before the caller reads the count, never seventeen).
    assert finished_in == {"short": 3, "long": 20}
    assert done_at["short"] < 20 <= done_at["long"]


async def test_request_level_batching_makes_the_late_arrival_wait_for_the_whole_batch(
    roomy_runner: LocalExecutor,
):
    # One token per step, to count steps (speculative decoding off).
    config = SchedulerConfig(scheduling="request", kv_policy="reserve", speculative="off")
    engine = IterationLoop(roomy_runner, config)
    await engine.start()
    order: list[tuple[str, int]] = []  # (request, engine steps when its only delta arrived)

    async def run(rid: str, stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
        deltas = await collect(stream)
        order.append((rid, engine.stats().num_steps))
        return deltas

    first_step = asyncio.Event()  # set on the loop thread as the first iteration is applied
    batches: dict[int, list[str]] = {}  # step -> the requests it ran

    def on_step(report: StepReport) -> None:
        batches[report.step] = list(report.request_ids)
        first_step.set()

    engine.add_step_listener(on_step)
    try:
        a = asyncio.create_task(run("a", engine.generate(prompt(8, 5), greedy(12), "a")))
        b = asyncio.create_task(run("b", engine.generate(prompt(8, 6), greedy(3), "b")))
        await asyncio.wait_for(first_step.wait(), GUARD_S)  # the batch {a, b} has run its first iteration
        assert engine.stats().running == 2
        late = await run("late", engine.generate(prompt(8, 7), greedy(2), "late"))
        deltas_a, deltas_b = await asyncio.gather(a, b)
    finally:
        await engine.shutdown()
    # b finished after 3 iterations but came back with a, after 12 (its consumer reads the step count
    # when it gets the delta, by which time the loop may have run later steps: hence >=); late ran
    # only after both, in steps of its own: its prompt and 2 tokens, 2 steps.
    assert [len(deltas_a), len(deltas_b), len(late)] == [1, 1, 1]
    assert dict(order)["b"] >= 12 and dict(order)["a"] >= 12
    assert max(step for step, ids in batches.items() if "a" in ids) == 12
    assert [step for step, ids in batches.items() if "b" in ids] == [1, 2, 3]
    assert [(step, ids) for step, ids in batches.items() if "late" in ids] == [(13, ["late"]), (14, ["late"])]


def test_bench_replays_the_workload_for_each_policy(tiny_llama_dir: Path, tmp_path: Path, capsys):
    from loadtest import inprocess as bench

    out = tmp_path / "rows.json"
    bench.main(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64"]
        + ["--block-size", "4", "--rates", "50,100", "--num-requests", "4", "--input-min", "4"]
        + ["--input-max", "12", "--output-max", "5", "--policies", "iteration:lazy,request:reserve"]
        + ["--json", str(out), "--slo-ms", "1000000"]
    )
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["rate"]) for r in rows] == [
        ("iteration:lazy", 50.0),
        ("iteration:lazy", 100.0),
        ("request:reserve", 50.0),
        ("request:reserve", 100.0),
    ]
    # the same 4 requests every run: same number of generated tokens
    assert all(r["num_requests"] == 4 and r["median_norm_latency_ms"] > 0 for r in rows)
    assert len({round(r["output_tokens_per_s"] * r["duration_s"]) for r in rows}) == 1
    printed = capsys.readouterr().out
    assert "median ms/tok" in printed and "request:reserve: highest rate" in printed
