"""TPOT at one stream (or --concurrency streams) next to the bare forward step: what the iteration
loop adds to a decode step, with overlapped scheduling off and on, in one run on one engine.

    python -m loadtest.tpot [--model ... --device ... --dtype ...] [--new-tokens 128] [--prompt-len 64]
                            [--concurrency 1] [--repeats 3] [--speculative off]

Bare step: engine.bench's decode steps (`executor.step` of a batch of --concurrency sequences built
by hand, so the forward pass and sampling and nothing else), median. TPOT: greedy requests (EOS
ignored) through IterationLoop, --concurrency of them started together, each one's (last token's
time - first token's) / (tokens - 1) as client-side benchmarks define it, averaged, and the median
gap between streamed deltas per token; for --overlap-schedule off, then on. A bare run and one run
of each mode follow each other, --repeats times, so a shared machine's drift falls on all three
alike. Speculation is off unless --speculative says otherwise: the figure is about the plain decode
path. Each row gives its ratio to the bare step (the issue's target at one stream: TPOT within 5% of
it), and the median time the executor sat idle between one step's end and the next
one's start (what the loop puts on the forward's critical path: the figure overlap should bring near
zero, and one a busy machine disturbs less than TPOT). Everything runs in the loop's one step thread
(scheduler.loop.IterationLoop says why), so the bare steps and the loop's steps use the same OpenMP
team.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.config import EngineConfig
from engine.contract import SamplingParams, ScheduledSequence, StepResult
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop, new_step_thread


@dataclass
class TpotRow:
    label: str
    tpot_ms: float  # mean over the runs of (last - first) / (tokens - 1)
    median_gap_ms: float  # median gap between streamed deltas per token, all runs pooled
    ratio: float  # tpot_ms / the bare step's median
    # Median time the executor sat idle between one step's end and the next one's start: what the
    # loop adds on the forward's critical path (what overlap removes), less noisy than TPOT.
    idle_ms: float | None = None
    # Median step inside the loop (executor submit to collect): against the bare step, whether the
    # loop's steps themselves are slower (work beside them) or only further apart (idle_ms).
    step_ms: float | None = None


@dataclass
class ModeRuns:
    tpots: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    idles: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)


class StepClock:
    """The executor, noting when each step starts (submit) and ends (collect returns). Steps are
    collected in the order they were submitted; on an accelerator the next one may be submitted before
    the one before is collected (scheduler.loop.IterationLoop._run_queued)."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self.spans: list[tuple[float, float]] = []
        self._starts: deque[float] = deque()

    def __getattr__(self, name: str) -> Any:  # every other attribute is the executor's (carries, ...)
        return getattr(self._executor, name)

    def submit(self, batch: Sequence[ScheduledSequence], **kwargs: Any) -> Any:
        self._starts.append(time.perf_counter())
        return self._executor.submit(batch, **kwargs)

    def collect(self, handle: Any) -> list[StepResult]:
        out = self._executor.collect(handle)
        self.spans.append((self._starts.popleft(), time.perf_counter()))
        return out

    def durations(self) -> list[float]:
        """Seconds of each step, submit to collect."""
        return [end - start for start, end in self.spans]

    def idle_gaps(self) -> list[float]:
        """Seconds between each step's end and the next one's start (negative where the next was queued
        before this one ended)."""
        return [b[0] - a[1] for a, b in zip(self.spans, self.spans[1:], strict=False)]


async def one_stream(
    engine: IterationLoop, prompt: Sequence[int], new_tokens: int, rid: str
) -> tuple[float, list[float]]:
    """One request's TPOT (seconds) and the gaps between its deltas after the first, per token (a
    delta holding several tokens, the consumer having fallen behind, spreads its gap over them)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    first = last = 0.0
    tokens = 0
    gaps: list[float] = []
    async for delta in engine.generate(prompt, params, rid):
        now = time.perf_counter()
        n = len(delta.token_ids)
        if not tokens:
            first = now
        elif n:
            gaps.append((now - last) / n)
        if n:
            last = now
        tokens += n
    return (last - first) / (tokens - 1), gaps


async def interleaved_runs(
    runner: Any, config: SchedulerConfig, step_thread: ThreadPoolExecutor, prompts: list[list[int]], args
) -> tuple[list[float], dict[bool, ModeRuns]]:
    """The bare decode steps' times, and TPOTs (one per stream), gaps and idle times per overlap mode:
    a bare run, then each mode's, repeat after repeat, so each ratio compares figures taken minutes
    apart at most (a shared machine's speed drifts more than the loop's overhead over a whole run);
    the streams of a run start together."""
    # Imported here: only this CLI needs the real engine's benchmark helpers.
    from engine.bench import WARMUP_STEPS, engine_decode

    bare: list[float] = []
    out = {False: ModeRuns(), True: ModeRuns()}
    for r in range(args.repeats + 1):  # run 0 of each warms up
        steps = step_thread.submit(engine_decode, runner, prompts, args.new_tokens, WARMUP_STEPS).result()
        if r:
            bare.extend(steps.decode_steps_s)
        for overlap in (False, True):
            clock = StepClock(runner)
            engine = IterationLoop(clock, replace(config, overlap_schedule=overlap), step_thread=step_thread)
            await engine.start()
            try:
                streams = [
                    one_stream(engine, p, args.new_tokens, f"run{r}-{overlap}-{i}")
                    for i, p in enumerate(prompts)
                ]
                results = await asyncio.gather(*streams)
            finally:
                await engine.shutdown()
            if r:
                for tpot, gaps in results:
                    out[overlap].tpots.append(tpot)
                    out[overlap].gaps.extend(gaps)
                out[overlap].idles.extend(clock.idle_gaps()[1:])  # after the prompts' step
                out[overlap].steps.extend(clock.durations()[1:])
    return bare, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.tpot", description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(p)
    SchedulerConfig.add_cli_args(p)
    p.set_defaults(speculative="off")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens")
    p.add_argument(
        "--concurrency", type=int, default=1, help="streams at once (the bare step decodes as many rows)"
    )
    p.add_argument("--repeats", type=int, default=3, help="measured runs per mode (after one warm-up run)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Imported here: only this CLI needs torch and the real engine.
    from engine.bench import make_prompts
    from engine.executor import LocalExecutor

    step_thread = new_step_thread()
    runner = step_thread.submit(LocalExecutor, EngineConfig.from_cli_args(args)).result()
    prompts = make_prompts(args.concurrency, args.prompt_len, runner.vocab_size, args.seed)
    config = SchedulerConfig.from_cli_args(args)
    bare, runs = asyncio.run(interleaved_runs(runner, config, step_thread, prompts, args))
    step_thread.shutdown()
    bare_ms = statistics.median(bare) * 1e3

    rows = [TpotRow("bare step (engine.bench)", bare_ms, bare_ms, 1.0)]
    for overlap, mode in runs.items():
        tpot_ms = statistics.mean(mode.tpots) * 1e3
        label = f"TPOT, --overlap-schedule {'on' if overlap else 'off'}"
        gap_ms = statistics.median(mode.gaps) * 1e3
        idle_ms = statistics.median(mode.idles) * 1e3 if mode.idles else None
        step_ms = statistics.median(mode.steps) * 1e3 if mode.steps else None
        rows.append(TpotRow(label, tpot_ms, gap_ms, tpot_ms / bare_ms, idle_ms, step_ms))
    print(
        f"{args.concurrency} stream(s) at once, prompt {args.prompt_len} tokens, {args.new_tokens} new "
        f"tokens, {args.repeats} runs each"
    )
    print(
        f"{'':34} {'ms/token':>9} {'median gap':>11} {'/ bare':>7} {'step in the loop':>17} "
        f"{'idle between steps':>19}"
    )
    for row in rows:
        step = f"{row.step_ms:14.3f} ms" if row.step_ms is not None else " " * 17
        idle = f"{row.idle_ms:16.3f} ms" if row.idle_ms is not None else ""
        print(f"{row.label:34} {row.tpot_ms:9.2f} {row.median_gap_ms:11.2f} {row.ratio:7.3f} {step} {idle}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
