"""A simulated accelerator for the iteration loop: how much of a device's time the loop's overlapped
scheduling leaves idle, measured on any machine.

`python -m loadtest.device_sim --step-ms 1 --streams 1,16` runs the real IterationLoop (scheduler,
overlap, detokenizer-free deltas) over `SimulatedDevice`: FakeRunner's deterministic model behind a
queue, as a GPU's stream is. submit() queues a step and returns; a device thread runs the steps in
order, each taking --step-ms (a sleep, the GIL released, as while a GPU computes), and collect() waits
for one. With `carry`, the loop submits a step before the one before is collected and the device reads
the carried rows' tokens from that one's results when it runs the step (engine.contract.DeviceCarry,
as the local executor does on a GPU); without, the loop collects the step before and puts the tokens
in on the host first (what an executor that cannot carry gets, and what the GPU path did before).

It reports TPOT per stream against the device's step time, and the device's idle time per step: the
host's share of the critical path that the protocol leaves. The loop's Python is real and so is this
machine's speed; the device is not (no memory traffic, no launch costs), so read the figures as what
the protocol allows, and the GPU's own (`scripts/gpu_check.sh tpot`) as what a GPU gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.contract import DeviceCarry, ScheduledSequence, StepResult, carriable_on_device
from loadtest.tpot import one_stream
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.loop import IterationLoop
from scheduler.overlap import last_tokens


@dataclass
class _Job:
    """A step on the simulated device's queue."""

    batch: Sequence[ScheduledSequence]
    carry: DeviceCarry | None
    done: threading.Event = field(default_factory=threading.Event)
    results: list[StepResult] | None = None
    error: Exception | None = None


class SimulatedDevice(FakeRunner):
    """FakeRunner's model behind an in-order queue that a device thread drains (module docstring)."""

    def __init__(self, step_s: float, carry: bool, **kw: Any) -> None:
        # A cache no stream outgrows: a full one would make the scheduler hold requests back.
        kw.setdefault("num_kv_blocks", 8192)
        kw.setdefault("max_model_len", 4096)
        super().__init__(simulate_kv=False, **kw)
        self.device_type = "sim"  # not "cpu": the loop overlaps as on an accelerator
        self.step_s = step_s
        self.samples_ahead = carry  # the draws are "on the device" for the next step to read
        self.busy: list[tuple[float, float]] = []  # (start, end) of each step on the device
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="simulated-device", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def submit(self, batch: Sequence[ScheduledSequence], carry: DeviceCarry | None = None) -> _Job:
        self._check_up()
        job = _Job(list(batch), carry)
        self._queue.put(job)
        return job

    def collect(self, handle: _Job) -> list[StepResult]:
        handle.done.wait()
        if handle.error is not None:
            raise handle.error
        assert handle.results is not None
        return handle.results

    def carries(self, handle: _Job, batch: Sequence[ScheduledSequence]) -> bool:
        """Whether the draws are kept for the next step and its carried rows can read them."""
        sampled = {s.request_id for s in handle.batch if s.sample}
        return self.samples_ahead and carriable_on_device(batch, sampled)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            start = time.perf_counter()
            time.sleep(self.step_s)
            try:
                job.results = self.step(self._with_carried_tokens(job))
            except Exception as exc:
                job.error = exc
            self.busy.append((start, time.perf_counter()))
            job.done.set()

    @staticmethod
    def _with_carried_tokens(job: _Job) -> list[ScheduledSequence]:
        """The step's rows with the carried ones' tokens read from the step before's results (run
        before this one, in order, as on a GPU's stream)."""
        if job.carry is None:
            return list(job.batch)
        before: _Job = job.carry.handle
        assert before.results is not None, "a carried step ran before the step it reads from"
        tokens = last_tokens(before.batch, before.results)
        batch = list(job.batch)
        for i in job.carry.rows:
            seq = batch[i]
            tok = tokens[seq.request_id]
            outputs = [*list(seq.output_token_ids)[:-1], tok]
            batch[i] = replace(seq, token_ids=(tok,), output_token_ids=outputs)
        return batch


@dataclass
class SimRow:
    mode: str  # "carried on the device" or "put in on the host"
    streams: int
    step_ms: float  # the device's median time per decode step, as measured (a sleep overshoots)
    tpot_ms: float  # mean over the streams of (last - first) / (tokens - 1)
    tpot_over_step: float
    idle_ms: float  # the device's median idle time between two decode steps


async def measure(carry: bool, streams: int, step_s: float, new_tokens: int) -> SimRow:
    device = SimulatedDevice(step_s, carry)
    loop = IterationLoop(device, SchedulerConfig(overlap_schedule=True, speculative="off", max_num_seqs=256))
    await loop.start()
    try:
        prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(streams)]
        runs = await asyncio.gather(
            *(one_stream(loop, p, new_tokens, f"s{i}") for i, p in enumerate(prompts))
        )
    finally:
        await loop.shutdown()
        device.close()
    spans = device.busy[2:]  # after the prompts' step and the first decode
    idle = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    step = statistics.median(end - start for start, end in spans)
    tpot = statistics.mean(t for t, _ in runs)
    return SimRow(
        "carried on the device" if carry else "put in on the host",
        streams,
        step * 1e3,
        tpot * 1e3,
        tpot / step,
        statistics.median(idle) * 1e3 if idle else 0.0,
    )


async def run_all(steps_ms: list[float], streams: list[int], new_tokens: int, repeats: int) -> list[SimRow]:
    rows: list[SimRow] = []
    for step_ms in steps_ms:
        for n in streams:
            for carry in (False, True):  # each mode's best of `repeats`: the machine's noise is one-sided
                runs = [await measure(carry, n, step_ms / 1e3, new_tokens) for _ in range(repeats)]
                rows.append(min(runs, key=lambda r: r.tpot_ms))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.device_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", default="1,5", help="the simulated device's time per step, comma-separated")
    p.add_argument("--streams", default="1,16", help="streams at once, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the fastest is reported")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    steps = [float(x) for x in args.step_ms.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    rows = asyncio.run(run_all(steps, streams, args.new_tokens, args.repeats))
    print(
        f"{'tokens of N in N+1':24} {'streams':>7} {'step ms':>8} {'TPOT ms':>8} {'TPOT/step':>9} {'idle ms':>8}"
    )
    for r in rows:
        print(
            f"{r.mode:24} {r.streams:7} {r.step_ms:8.2f} {r.tpot_ms:8.3f} {r.tpot_over_step:9.3f} {r.idle_ms:8.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
