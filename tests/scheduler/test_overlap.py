"""Overlapped scheduling (scheduler/overlap.py, Scheduler.schedule(pending=...), the loop's
_iterate_overlapped): the same tokens with overlap on and off, every KV block back, finishes one step
late with the extra row discarded. The fake runner checks every row's tokens and K/V reads against the
request's own context, so a carried row at a wrong position or with a wrong token raises."""

from __future__ import annotations

import asyncio
import threading
import zlib
from array import array
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from fakes import cramped_runner, greedy_through_loop, run_overlapped, run_to_end
from test_scheduler import expected_outputs, over_random_workloads, prompt_of
from test_speculation import quoting_model, text_prompt
from waiting import wait_until

from engine.contract import PENDING_TOKEN, SampledToken, SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.fake_runner import FakeDetokenizer, FakeRunner, hash_next_token, mostly_right_draft
from scheduler.loop import IterationLoop, new_step_thread
from scheduler.output_text import start_output
from scheduler.overlap import CarriedOutputs, last_tokens, resolve
from scheduler.request import Request
from scheduler.speculation import SpeculationPolicy

DETOK = FakeDetokenizer()
GUARD_S = 20
EOS = 2


def sometimes_eos(context: Sequence[int]) -> int:
    """The hash model, saying EOS one time in nine: requests end at different, unforeseeable steps."""
    if zlib.crc32(array("q", context).tobytes()) % 9 == 0:
        return EOS
    return hash_next_token(context)


def prompt(seed: int, n: int = 13) -> list[int]:
    return text_prompt(seed, n)


def make_request(rid: str, tokens: Sequence[int], **params) -> Request:
    sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **params})
    return Request(rid, tokens, sampling, output_text=start_output(DETOK, tokens, sampling))


# Scenario -> (scheduler config, runner kwargs, the requests' prompts and sampling).
SHARED = [7, *range(300, 320)]  # a prefix of five blocks of 4 that every prompt of "prefix caching" has
SCENARIOS = {
    "alone": (dict(), dict(), [(prompt(0), dict(max_tokens=30))]),
    "batched": (dict(), dict(), [(prompt(i, 5 + 3 * i), dict(max_tokens=10 + 4 * i)) for i in range(6)]),
    "eos": (dict(), dict(token_fn=sometimes_eos), [(prompt(i), dict(max_tokens=40)) for i in range(6)]),
    "logprobs": (dict(), dict(), [(prompt(i), dict(logprobs=2, max_tokens=9 + i)) for i in range(3)]),
    "chunked prefill": (
        dict(max_num_batched_tokens=9, max_num_seqs=4),
        dict(),
        [(prompt(i, 20 + i), dict(max_tokens=12)) for i in range(4)],
    ),
    "preemption": (dict(max_num_seqs=4), dict(num_kv_blocks=14), [(prompt(i), dict()) for i in range(4)]),
    "reserve": (dict(kv_policy="reserve"), dict(num_kv_blocks=30), [(prompt(i), dict()) for i in range(4)]),
    "request batching": (
        dict(scheduling="request", kv_policy="reserve", max_num_seqs=3),
        dict(),
        [(prompt(i), dict(max_tokens=8 + 5 * i)) for i in range(5)],
    ),
    "prefix caching": (dict(), dict(), [([*SHARED, 400 + i], dict(max_tokens=10)) for i in range(5)]),
    "prefix caching, chunked": (
        dict(max_num_batched_tokens=8, max_num_seqs=4),
        dict(),
        [([*SHARED, *range(500, 500 + i), 400 + i], dict(max_tokens=10)) for i in range(5)],
    ),
    "prompt logprobs, chunked": (
        dict(max_num_batched_tokens=6, max_num_seqs=2),
        dict(),
        [(prompt(i, 17), dict(prompt_logprobs=1, max_tokens=5)) for i in range(2)],
    ),
    "max model len": (
        dict(),
        dict(max_model_len=40),
        [(prompt(i, 20), dict(max_tokens=20)) for i in range(2)],
    ),
    "seeded sampling": (
        dict(),
        dict(),
        [(prompt(i), dict(temperature=0.8, seed=i, max_tokens=12)) for i in range(3)],
    ),
    "ngram speculation": (
        dict(speculative="ngram"),
        dict(token_fn=quoting_model),
        [(prompt(i), dict(max_tokens=30)) for i in range(3)],
    ),
    "draft speculation": (
        dict(speculative="draft"),
        dict(draft_fn=mostly_right_draft),
        [(prompt(i), dict(max_tokens=30)) for i in range(3)],
    ),
}


def run_scenario(name: str, overlap: bool) -> tuple[list[Request], Scheduler, int]:
    cfg, runner_kw, specs = SCENARIOS[name]
    runner = FakeRunner(**runner_kw)
    sched = Scheduler.for_executor(SchedulerConfig(**{"speculative": "off", **cfg}), runner)
    requests = [make_request(f"r{i}", p, **params) for i, (p, params) in enumerate(specs)]
    carried = 0
    if overlap:
        carried = run_overlapped(sched, runner, requests)
    else:
        run_to_end(sched, runner, requests)
    return requests, sched, carried


def results(requests: list[Request]) -> list[tuple]:
    return [
        (r.output_token_ids, r.finish_reason, r.output_text.take(), r.num_cached_tokens, r.prompt_logprobs)
        for r in requests
    ]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_tokens_with_overlap_on_and_off(scenario):
    sync, _, _ = run_scenario(scenario, overlap=False)
    overlapped, sched, carried = run_scenario(scenario, overlap=True)
    assert results(overlapped) == results(sync)
    assert sched.allocator.num_used == 0 and not sched.requests  # every block back, nothing held
    if "speculation" in scenario:
        assert sched.stats().speculation.accepted_tokens > 0  # overlap does not starve speculation
    else:
        assert carried > 0  # the plain path overlaps
    if scenario == "preemption":
        assert sched.num_preemptions > 0
    if scenario == "eos":
        assert any(r.output_token_ids[-1] == EOS for r in overlapped)


@over_random_workloads
def test_random_workloads_give_the_same_tokens_overlapped(wl, config, block_size, extra_blocks):
    """Arrivals over time, aborts, stop strings, a cramped cache (preemption, eviction), every policy,
    speculation on and off: each request's tokens are those of a synchronous run (an aborted one's, a
    prefix of them), and every block comes back."""
    longest = max(p + m for _, p, m in wl.arrivals)
    stops = {
        i: DETOK.text(expected_outputs(prompt_of(f"r{i}", wl.arrivals[i][1]), k)[-1])
        for i, k in wl.stop_at.items()
    }

    def requests() -> list[Request]:
        return [
            make_request(f"r{i}", prompt_of(f"r{i}", p), max_tokens=m, stop=(stops[i],) if i in stops else ())
            for i, (_, p, m) in enumerate(wl.arrivals)
        ]

    reference = requests()  # all at once, synchronously, never aborted (greedy: the same tokens)
    plain = cramped_runner(longest, block_size, extra_blocks)
    run_to_end(Scheduler.for_executor(config, plain), plain, reference)
    runner = cramped_runner(longest, block_size, extra_blocks)
    sched = Scheduler.for_executor(config, runner)
    reqs = requests()
    aborted = {i for ids in wl.aborts.values() for i in ids}

    def each_step(n: int) -> bool:
        for (at, _, _), r in zip(wl.arrivals, reqs, strict=True):
            if at == n:
                sched.add(r)
        for i in wl.aborts.get(n, []):
            sched.abort(reqs[i].request_id)
        return n < max(max(a for a, _, _ in wl.arrivals), max(wl.aborts, default=0))

    run_overlapped(sched, runner, [], each_step=each_step)
    for i, (r, ref) in enumerate(zip(reqs, reference, strict=True)):
        if i in aborted:
            assert r.output_token_ids == ref.output_token_ids[: len(r.output_token_ids)]
        else:
            assert (r.output_token_ids, r.finish_reason) == (ref.output_token_ids, ref.finish_reason)
    assert sched.allocator.num_used == 0 and not sched.requests


def test_a_carried_row_continues_at_the_next_position_with_the_token_to_come():
    runner = FakeRunner()
    sched = Scheduler.for_executor(SchedulerConfig(speculative="off"), runner)
    sched.add(make_request("a", prompt(0, 6), max_tokens=5))
    first = sched.schedule()
    assert [s.start_position for s in first.seqs] == [0]
    second = sched.schedule(pending=first)  # the prompt's step has not been applied
    (row,) = second.seqs
    assert list(row.token_ids) == [PENDING_TOKEN] and row.start_position == 6 and row.sample
    assert len(row.block_table) == 2  # 7 tokens, blocks of 4
    sampled = runner.step(first.seqs)
    (resolved,), kept = resolve(second.seqs, second.requests, last_tokens(first.seqs, sampled))
    assert kept is None
    assert isinstance(sampled[0], SampledToken)
    assert list(resolved.token_ids) == [sampled[0].token_id]
    assert list(resolved.output_token_ids) == [sampled[0].token_id]


def test_a_prompt_chunk_continues_with_the_next_chunk_while_it_runs():
    sched = Scheduler.for_executor(
        SchedulerConfig(speculative="off", max_num_batched_tokens=8, max_num_seqs=2), FakeRunner()
    )
    req = make_request("a", prompt(0, 20))
    sched.add(req)
    first = sched.schedule()
    second = sched.schedule(pending=first)
    third = sched.schedule(pending=second)
    rows = [(s.start_position, list(s.token_ids), s.sample) for s in (*first.seqs, *second.seqs, *third.seqs)]
    assert rows == [
        (0, req.prompt_token_ids[:8], False),
        (8, req.prompt_token_ids[8:16], False),
        (16, req.prompt_token_ids[16:], True),
    ]
    assert len(req.block_ids) == 5  # 20 tokens in blocks of 4, none computed yet


def test_carried_outputs_read_only_what_they_were_scheduled_with():
    live = [5, 6]
    view = CarriedOutputs(live, 2, 7)
    live.append(7)  # the event loop applies the step meanwhile
    live.append(8)
    assert list(view) == [5, 6, 7] and len(view) == 3 and view[-1] == 7 and view[1:] == [6, 7]
    assert view[2:3] == [7] and view[:2] == [5, 6] and view[3:] == [] and view[::2] == [5, 7]
    with pytest.raises(IndexError):
        view[3]


def test_a_request_that_ends_by_length_is_not_carried_but_one_with_a_grammar_is():
    """Known to end: no row wasted. A grammar's matcher is advanced on the worker's side, past the
    token put in, when the row's mask is made."""
    sched = Scheduler.for_executor(SchedulerConfig(speculative="off"), FakeRunner())
    for r in [
        make_request("plain", prompt(0)),
        make_request("grammar", prompt(1), grammar=object()),
        make_request("last", prompt(2), max_tokens=1),
    ]:
        sched.add(r)
    first = sched.schedule()
    second = sched.schedule(pending=first)
    assert [s.request_id for s in second.seqs] == ["plain", "grammar"]


def test_a_verification_in_flight_is_not_carried():
    """How many of its proposals are accepted decides where the request goes on."""
    runner = FakeRunner(draft_fn=mostly_right_draft)
    sched = Scheduler.for_executor(SchedulerConfig(speculative="draft"), runner)
    for i in range(2):
        sched.add(make_request(f"r{i}", prompt(i)))
    first = sched.schedule()
    sched.update(first, runner.step(first.seqs))
    verifying = sched.schedule()
    assert all(s.num_spec_tokens for s in verifying.seqs)
    sched.speculation = None  # not the policy's choice: the verification alone keeps them waiting
    assert not sched.schedule(pending=verifying).seqs


def test_speculation_keeps_a_request_waiting_only_where_a_proposal_would_pay():
    policy = SpeculationPolicy("ngram", max_tokens=4, max_batch=8, token_cost=0.12)
    fresh = make_request("fresh", [5, 6, 7, 8])  # no token repeats: nothing to look up
    assert not policy.worth_waiting(fresh, 1)
    copying = make_request("copying", [5, 6, 7, 8, 5, 6])  # "5 6" occurred before: "7" likely follows
    assert policy.worth_waiting(copying, 1)
    assert not policy.worth_waiting(copying, 9)  # past max_batch nobody proposes
    for _ in range(40):  # proposals of its kind are rejected again and again
        policy.acceptance.record((3, "none"), 4, 0)
    assert not policy.worth_waiting(copying, 1)


def test_a_failed_step_drops_the_carried_rows_of_its_requests():
    runner = FakeRunner()
    sched = Scheduler.for_executor(SchedulerConfig(speculative="off"), runner)
    for i in range(2):
        sched.add(make_request(f"r{i}", prompt(i)))
    first = sched.schedule()
    second = sched.schedule(pending=first)
    assert len(second.seqs) == 2
    sched.fail(first.requests[:1], "injected")  # the step failed for r0 (its token never came)
    tokens = last_tokens(first.seqs[1:], runner.step(first.seqs)[1:])
    rows, kept = resolve(second.seqs, second.requests, tokens)
    assert [r.request_id for r in rows] == ["r1"] and kept == [1]


# ---- through the loop -----------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [256, 12])  # 12: preemptions
async def test_the_loop_gives_the_same_tokens_with_overlap_on_and_off(blocks):
    prompts = [prompt(i, 4 + 5 * i) for i in range(6)]

    async def run(on: bool) -> tuple[list[list[int]], IterationLoop]:
        loop = IterationLoop(
            FakeRunner(num_kv_blocks=blocks), SchedulerConfig(overlap_schedule=on, max_num_seqs=4)
        )
        return await greedy_through_loop(None, prompts, 17, engine=loop), loop

    sync, _ = await run(False)
    overlapped, loop = await run(True)
    assert overlapped == sync
    assert loop.stats().kv_blocks_used == 0


async def test_stop_strings_and_eos_end_at_the_same_token_with_overlap():
    pieces = {t: f" w{t % 13}" for t in range(17, 20017)}
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=(" w3",)),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=40, stop=(" w5 w",), ignore_eos=True),
    ]

    async def run(on: bool) -> list[tuple]:
        runner = FakeRunner(token_fn=sometimes_eos)
        loop = IterationLoop(
            runner, SchedulerConfig(overlap_schedule=on), detokenizer=FakeDetokenizer(pieces)
        )
        await loop.start()

        async def one(i: int) -> tuple:
            deltas = [d async for d in loop.generate(prompt(i), params[i % 3], f"r{i}")]
            return (
                [t for d in deltas for t in d.token_ids],
                "".join(d.text for d in deltas),
                deltas[-1].finish_reason,
                deltas[-1].stop_string,
                [lp for d in deltas for lp in d.logprobs or ()],
            )

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(9))), GUARD_S)
        finally:
            assert loop.stats().kv_blocks_used == 0
            await loop.shutdown()

    assert await run(True) == await run(False)


async def test_an_aborted_request_frees_its_blocks_while_its_rows_are_in_flight():
    """The client leaves while a step with its row runs and the next, carrying it, is queued: its
    blocks are free once that step is applied, and the other request goes on undisturbed."""
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    loop = IterationLoop(runner, SchedulerConfig(overlap_schedule=True, speculative="off"))
    await loop.start()
    params = SamplingParams(temperature=0.0, max_tokens=30)
    leaving = loop.generate(prompt(0), params, "leaving")
    staying = loop.generate(prompt(1), params, "staying")
    gate.set()
    first = await asyncio.wait_for(anext(leaving), GUARD_S)
    assert first.token_ids
    gate.clear()  # hold a step in flight
    runner.step_started.clear()
    await asyncio.wait_for(asyncio.to_thread(runner.step_started.wait, GUARD_S), GUARD_S)
    await leaving.aclose()
    gate.set()
    tokens = [t async for d in staying for t in d.token_ids]
    await wait_until(lambda: loop.stats().kv_blocks_used == 0 and loop.stats().running == 0)
    await loop.shutdown()
    alone = await greedy_through_loop(FakeRunner(), [prompt(1)], 30)
    assert tokens == alone[0]


@pytest.mark.parametrize(
    ("chosen", "device_type", "num_seqs", "ahead"),
    [
        (None, "cpu", 1, False),  # auto, one stream on a CPU: one delta to hide, the forward would pay more
        (None, "cpu", 2, True),  # auto, more streams on a CPU: their deltas are worth hiding
        (None, "cuda", 1, True),  # auto: a GPU step leaves the CPU to the loop
        (True, "cpu", 1, True),
        (False, "cuda", 8, False),
    ],
)
def test_auto_schedules_ahead_where_it_pays(chosen, device_type, num_seqs, ahead):
    runner = FakeRunner()
    runner.device_type = device_type
    loop = IterationLoop(runner, SchedulerConfig(overlap_schedule=chosen))
    assert loop._overlaps() is (chosen is not False)
    pending = SimpleNamespace(num_seqs=num_seqs)
    assert loop._schedules_ahead(pending) is ahead


async def test_auto_on_a_cpu_gives_the_same_tokens_one_stream_or_many():
    """One stream steps one step after another, several overlap: the same tokens as on and off."""
    prompts = [prompt(i, 4 + 5 * i) for i in range(3)]

    async def run(chosen: bool | None, streams: int) -> list[list[int]]:
        runner = FakeRunner()
        runner.device_type = "cpu"
        loop = IterationLoop(runner, SchedulerConfig(overlap_schedule=chosen, max_num_seqs=4))
        tokens = await greedy_through_loop(None, prompts[:streams], 9, engine=loop)
        assert loop.stats().kv_blocks_used == 0
        return tokens

    for streams in (1, 3):
        assert await run(None, streams) == await run(False, streams) == await run(True, streams)


class LaunchWatch(FakeRunner):
    """Notes, as each step's submit() returns, whether the client has its first token yet; the second
    step's submit() first waits `wait_s` for it, so that a loop handing the tokens over too early is
    seen doing it."""

    def __init__(self, wait_s: float, **kw) -> None:
        super().__init__(**kw)
        self.wait_s = wait_s
        self.first_token = threading.Event()
        self.seen_at_submit: list[bool] = []

    def submit(self, batch):
        handle = super().submit(batch)
        if len(self.seen_at_submit) == 1:
            self.first_token.wait(self.wait_s)
        self.seen_at_submit.append(self.first_token.is_set())
        return handle


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
async def test_a_steps_tokens_reach_the_loop_when_the_device_is_free_for_it(device_type):
    """On an accelerator a step's tokens go to the loop only once the step queued behind it is launched
    (so the loop's Python runs while the device computes, not while the next step's inputs are built);
    on a CPU, where submit() is the forward itself, as soon as the step ends (else the loop would sit
    through the whole next forward). Either way the tokens are those without overlap."""
    gate = threading.Event()
    # On a GPU the token must not come while the next step is launched (a second is long enough to see
    # one that does; the check passes however loaded the machine is); on a CPU it must come.
    runner = LaunchWatch(wait_s=1.0 if device_type == "cuda" else GUARD_S, gate=gate)
    runner.device_type = device_type
    thread = new_step_thread()
    loop = IterationLoop(
        runner, SchedulerConfig(overlap_schedule=True, speculative="off"), step_thread=thread
    )
    await loop.start()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def client() -> list[int]:
        tokens: list[int] = []
        async for delta in loop.generate(prompt(3), params, "r"):
            tokens += delta.token_ids
            if tokens:
                runner.first_token.set()
        return tokens

    try:
        task = asyncio.create_task(client())
        # The prompt's step is held on the worker until the next step (carrying the request) is queued
        # behind it. On an accelerator the prompt's step is collected by the next step's job (this
        # executor cannot carry tokens on the device, so before that one is submitted): once it is
        # collecting, the next step is on the worker already.
        await asyncio.wait_for(asyncio.to_thread(runner.step_started.wait, GUARD_S), GUARD_S)
        if device_type == "cpu":
            await wait_until(lambda: thread._work_queue.qsize() >= 1)
        gate.set()
        tokens = await asyncio.wait_for(task, GUARD_S)
    finally:
        gate.set()
        await loop.shutdown()
        thread.shutdown()
    assert runner.seen_at_submit[:2] == [False, device_type == "cpu"]
    assert tokens == (await greedy_through_loop(FakeRunner(), [prompt(3)], 12))[0]
