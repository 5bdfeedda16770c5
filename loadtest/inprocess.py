"""Replay ORCA's synthetic workload into IterationLoop, in process (no HTTP), for each policy and rate.

    python -m loadtest.inprocess --rates 0.5,1,2 --num-requests 100

Workload (the paper's section 6): Poisson arrivals at each rate, input length uniform in [32, 512],
output length uniform in [1, 128], EOS ignored (every request generates exactly its output length).
The same requests (same prompts, lengths and arrival gaps, scaled by the rate) are replayed for every
policy. Reported per (policy, rate): request throughput, output tokens/s, and the median normalized
latency (end-to-end latency / generated tokens, ms/token), the paper's y axis.

The engine is the real one (engine.executor.LocalExecutor), built once and shared by every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from engine.config import EngineConfig
from engine.contract import Executor, SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop, new_step_thread
from scheduler.outputs import FinishReason

logger = logging.getLogger("loadtest.inprocess")


@dataclass(frozen=True)
class WorkItem:
    gap: float  # inter-arrival gap in units of 1/rate (an Exp(1) draw)
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_output_tokens: int


@dataclass
class RunSummary:
    policy: str
    rate: float
    num_requests: int
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    median_norm_latency_ms: float  # per generated token
    p90_norm_latency_ms: float
    median_ttft_s: float
    num_preemptions: int
    num_steps: int


def make_workload(
    num_requests: int,
    seed: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_range)
        items.append(
            WorkItem(
                gap=rng.expovariate(1.0),
                # Random ids away from the special tokens at the bottom of the vocabulary.
                prompt_ids=[rng.randrange(100, vocab_size) for _ in range(n_in)],
                output_len=rng.randint(*output_range),
            )
        )
    return items


async def replay(engine: IterationLoop, workload: Sequence[WorkItem], rate: float) -> list[RequestResult]:
    """Send each request at its Poisson arrival time and consume its stream; returns one result each."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int, item: WorkItem, arrival: float) -> RequestResult:
        await asyncio.sleep(max(0.0, arrival - (loop.time() - t0)))
        start = loop.time()
        params = SamplingParams(temperature=0.0, max_tokens=item.output_len, ignore_eos=True)
        first = None
        n_out = 0
        async for delta in engine.generate(item.prompt_ids, params, f"bench-{i}"):
            if first is None and delta.token_ids:
                first = loop.time()
            n_out = delta.num_output_tokens
            if delta.finish_reason is not None and delta.finish_reason is not FinishReason.LENGTH:
                raise RuntimeError(f"request {i} ended with {delta.finish_reason}: {delta.error}")
        end = loop.time()
        return RequestResult(start - t0, (first or end) - t0, end - t0, n_out)

    arrival = 0.0
    tasks = []
    for i, item in enumerate(workload):
        arrival += item.gap / rate
        tasks.append(asyncio.create_task(one(i, item, arrival)))
    return await asyncio.gather(*tasks)


def within(workload: Sequence[WorkItem], rate: float, duration: float) -> Sequence[WorkItem]:
    """The prefix of the workload that arrives within `duration` seconds at `rate` (at least one)."""
    t = 0.0
    for i, item in enumerate(workload):
        t += item.gap / rate
        if t > duration:
            return workload[: max(1, i)]
    return workload


def summarize(
    policy: str, rate: float, results: Sequence[RequestResult], engine: IterationLoop
) -> RunSummary:
    duration = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    norm = sorted((r.finish_s - r.arrival_s) / r.num_output_tokens * 1000.0 for r in results)
    stats = engine.stats()
    return RunSummary(
        policy=policy,
        rate=rate,
        num_requests=len(results),
        duration_s=duration,
        throughput_rps=len(results) / duration,
        output_tokens_per_s=sum(r.num_output_tokens for r in results) / duration,
        median_norm_latency_ms=statistics.median(norm),
        p90_norm_latency_ms=norm[min(len(norm) - 1, int(0.9 * len(norm)))],
        median_ttft_s=statistics.median(r.first_token_s - r.arrival_s for r in results),
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
    )


def parse_policy(text: str) -> tuple[str, str]:
    """ "iteration:lazy" -> ("iteration", "lazy"); a bare scheduling name takes the default KV policy."""
    scheduling, _, kv = text.partition(":")
    return scheduling, kv or "lazy"


def print_table(rows: Sequence[RunSummary], slo_ms: float | None) -> None:
    # Plain text, not a rich table: this goes to logs and pipes, where rich would wrap at 80 columns.
    header = ("policy", "rate req/s", "req/s", "out tok/s", "median ms/tok", "p90 ms/tok", "TTFT p50 s")
    header += ("preempt", "steps", "n")
    lines = [header] + [
        (
            r.policy,
            f"{r.rate:g}",
            f"{r.throughput_rps:.3f}",
            f"{r.output_tokens_per_s:.1f}",
            f"{r.median_norm_latency_ms:.1f}",
            f"{r.p90_norm_latency_ms:.1f}",
            f"{r.median_ttft_s:.2f}",
            str(r.num_preemptions),
            str(r.num_steps),
            str(r.num_requests),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    if slo_ms is not None:
        # The paper's comparison: the highest rate each policy sustains under a latency target.
        for policy in dict.fromkeys(r.policy for r in rows):
            ok = [r.rate for r in rows if r.policy == policy and r.median_norm_latency_ms <= slo_ms]
            best = f"{max(ok):g} req/s" if ok else "none of the rates tried"
            print(f"{policy}: highest rate with median <= {slo_ms:g} ms/token: {best}")


async def run_all(
    runner: Executor, args: argparse.Namespace, step_thread: ThreadPoolExecutor
) -> list[RunSummary]:
    vocab = int(getattr(runner, "vocab_size", 32000))
    workload = make_workload(
        args.num_requests,
        args.seed,
        (args.input_min, args.input_max),
        (args.output_min, args.output_max),
        vocab,
    )
    rows = []
    for spec in args.policies.split(","):
        scheduling, kv_policy = parse_policy(spec.strip())
        # The flags' scheduler config, with this run's policies.
        config = replace(SchedulerConfig.from_cli_args(args), scheduling=scheduling, kv_policy=kv_policy)
        for rate in (float(r) for r in args.rates.split(",")):
            items = workload if args.duration is None else within(workload, rate, args.duration)
            engine = IterationLoop(runner, config, step_thread=step_thread)
            await engine.start()
            try:
                t = time.perf_counter()
                results = await replay(engine, items, rate)
                row = summarize(f"{scheduling}:{kv_policy}", rate, results, engine)
            finally:
                await engine.shutdown()
            logger.info("%s at %g req/s done in %.1fs", row.policy, rate, time.perf_counter() - t)
            rows.append(row)
    return rows


async def warm_up(runner: Executor, step_thread: ThreadPoolExecutor) -> None:
    """One short request, so the first measured step does not pay for lazy initialisation."""
    engine = IterationLoop(runner, SchedulerConfig(), step_thread=step_thread)
    await engine.start()
    try:
        async for _ in engine.generate(
            list(range(100, 132)), SamplingParams(temperature=0.0, max_tokens=2), "warm"
        ):
            pass
    finally:
        await engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.inprocess", description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(p)  # --seed also seeds the workload
    SchedulerConfig.add_cli_args(p)
    p.add_argument("--rates", default="0.25,0.5,1,2", help="request rates (req/s), comma-separated")
    p.add_argument("--num-requests", type=int, default=100, help="requests per (policy, rate) run")
    p.add_argument(
        "--duration", type=float, default=None, help="instead of --num-requests: seconds of arrivals"
    )
    p.add_argument(
        "--policies",
        default="iteration:lazy,iteration:reserve,request:reserve",
        help="comma-separated scheduling:kv_policy pairs (iteration|request : lazy|reserve)",
    )
    p.add_argument("--input-min", type=int, default=32)
    p.add_argument("--input-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=1)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--slo-ms", type=float, default=None, help="report the highest rate under this ms/token")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.duration is not None:
        # Enough requests to cover the duration at the highest rate; runs at lower rates use a prefix.
        args.num_requests = max(1, round(args.duration * max(float(r) for r in args.rates.split(","))))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Imported here: the scheduler package stays free of torch, only this CLI needs the real engine.
    from engine.executor import LocalExecutor

    # Built in the thread its steps run in: one OpenMP thread team (scheduler.loop.IterationLoop says why).
    step_thread = new_step_thread()
    runner = step_thread.submit(LocalExecutor, EngineConfig.from_cli_args(args)).result()
    asyncio.run(warm_up(runner, step_thread))
    rows = asyncio.run(run_all(runner, args, step_thread))
    step_thread.shutdown()
    print_table(rows, args.slo_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
