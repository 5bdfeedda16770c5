"""Does an open live view slow the iteration loop? Steps/s of the real app with the fake runner (no model:
the loop's own overhead is all there is, so any cost of the view shows at its largest), for:

- webui off: no live feed, no listener on the loop;
- view closed: the feed's listener appends each step's report, nobody reads;
- 1 / 8 viewers: `curl -N` processes reading /live/events (as a browser tab would, in another process);
- a stalled viewer: a client that sends the request and never reads (its socket buffers fill up).

    python -m server.bench_live --seconds 5 --concurrency 32

Requests go straight into the engine (no HTTP for generation), a closed loop of `--concurrency` at a
time, so the loop runs as many steps as it can. Reported per case (medians over the repeats): steps/s, and the
server process's CPU time per step (all its threads; steadier than steps/s where other work shares the
cores), each with its ratio to "view closed".
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import uvicorn

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.ports import LOOPBACK, free_tcp_port
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.outputs import StepReport
from server.app import create_app
from server.config import ServerConfig
from server.live_feed import FeedLimits, IterationFeed, encode_message
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer

HOST = LOOPBACK


@dataclass
class Case:
    name: str
    webui: bool
    curl_viewers: int = 0
    stalled_viewer: bool = False


CASES = (
    Case("webui off", webui=False),
    Case("view closed", webui=True),
    Case("1 viewer", webui=True, curl_viewers=1),
    Case("8 viewers", webui=True, curl_viewers=8),
    Case("stalled viewer", webui=True, stalled_viewer=True),
)


@dataclass
class Result:
    case: str
    steps_per_s: float
    # This process's CPU time (all its threads) per step: steadier than steps/s on a shared machine.
    cpu_us_per_step: float
    viewer_bytes: int  # what the curl viewers received, in all


async def run_case(case: Case, tokenizer: ServerTokenizer, args: argparse.Namespace) -> Result:
    runner = FakeRunner(num_kv_blocks=8192, block_size=16, max_model_len=1024)
    port = free_tcp_port()
    config = ServerConfig(
        engine=EngineConfig(model="fake"),
        scheduler=SchedulerConfig(
            max_num_seqs=args.concurrency, max_num_batched_tokens=max(2048, args.concurrency)
        ),
        port=port,
        webui=case.webui,
        log_stats_interval_s=0,
    )
    app = create_app(config, lambda: LoadedModel(runner, tokenizer, runner.vocab_size))
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    state = app.state.server
    await state.wait_ready()
    loop = state.loop
    url = f"http://{HOST}:{port}/live/events"
    viewers = [
        subprocess.Popen(["curl", "-sN", url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for _ in range(case.curl_viewers)
    ]
    stalled = None
    if case.stalled_viewer:
        stalled = socket.create_connection((HOST, port))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(f"GET /live/events HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())

    ids = itertools.count()
    stop = False

    async def client() -> None:
        while not stop:
            prompt = [100 + (i * 7) % 500 for i in range(args.prompt_len)]
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
            async for _ in loop.generate(prompt, params, f"bench-{next(ids)}"):
                pass

    clients = [asyncio.create_task(client()) for _ in range(args.concurrency)]
    await asyncio.sleep(args.warmup)
    steps0, cpu0, t0 = loop.stats().num_steps, time.process_time(), time.perf_counter()
    await asyncio.sleep(args.seconds)
    steps1, cpu1, t1 = loop.stats().num_steps, time.process_time(), time.perf_counter()
    stop = True
    await asyncio.gather(*clients)
    received = 0
    for proc in viewers:
        proc.terminate()
        received += len(proc.communicate()[0])
    if stalled is not None:
        stalled.close()
    state.start_draining()
    server.should_exit = True
    await serving
    steps = steps1 - steps0
    return Result(case.name, steps / (t1 - t0), (cpu1 - cpu0) * 1e6 / steps, received)


async def main_async(args: argparse.Namespace) -> list[Result]:
    from models.loader import load_tokenizer, resolve_model

    tokenizer = ServerTokenizer(load_tokenizer(resolve_model("default")))
    results = []
    for _ in range(args.repeats):
        for case in CASES:
            result = await run_case(case, tokenizer, args)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    return results


def summarise(results: list[Result]) -> str:
    """Median over the repeats of each case, and its ratio to "view closed"."""
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    base_rate = median([r.steps_per_s for r in by_case["view closed"]])
    base_cpu = median([r.cpu_us_per_step for r in by_case["view closed"]])
    lines = [f"{'case':<16} {'steps/s':>9} {'vs closed':>10} {'CPU us/step':>12} {'vs closed':>10}"]
    for name, runs in by_case.items():
        rate = median([r.steps_per_s for r in runs])
        cpu = median([r.cpu_us_per_step for r in runs])
        lines.append(
            f"{name:<16} {rate:>9.0f} {rate / base_rate:>10.3f} {cpu:>12.0f} {cpu / base_cpu:>10.3f}"
        )
    return "\n".join(lines)


def feed_costs(batch: int, limits: FeedLimits) -> str:
    """The feed's own work, timed alone: the listener's append (on the loop's step path) and the
    sender's encoding of a full message (off it, once per interval for all viewers)."""
    ids = [f"chatcmpl-{i:032x}-0" for i in range(batch)]
    reports = [
        StepReport(
            num_seqs=batch,
            num_tokens=batch,
            num_prompt_tokens=0,
            num_decode_tokens=batch,
            duration_s=0.001,
            step=step,
            request_ids=ids,
            request_num_tokens=[1] * batch,
            request_start_positions=list(range(100, 100 + batch)),
            request_is_decode=[True] * batch,
        )
        for step in range(1, 2 * limits.max_steps_per_message + 1)
    ]
    feed = IterationFeed(limits)
    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        feed.on_step(reports[i % len(reports)])
    append_ns = (time.perf_counter() - t0) / n * 1e9
    t0 = time.perf_counter()
    for _ in range(100):
        message = encode_message(reports, limits.max_steps_per_message, limits.max_entries_per_message)
    encode_ms = (time.perf_counter() - t0) / 100 * 1e3
    per_second = encode_ms / limits.interval_s / 10  # percent of one core
    steps = json.loads(message)["steps"]
    return (
        f"listener append: {append_ns:.0f} ns/step; encoding a full message ({len(steps)} "
        f"steps x {batch} requests, {len(message) / 1024:.0f} KiB): {encode_ms:.2f} ms, at most every "
        f"{limits.interval_s * 1000:.0f} ms = {per_second:.1f}% of one core, shared by all viewers"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per case")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (the batch size)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="rounds over all cases (interleaved)")
    args = p.parse_args()
    print(feed_costs(args.concurrency, FeedLimits()), flush=True)
    print(summarise(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
