"""Speculative decoding in the scheduler (scheduler/speculation.py, Scheduler.schedule/update) against
the fake runner, which verifies proposals token by token from its simulated KV cache: the n-gram
index, the cost-model policy, and the bookkeeping (rollback of rejected proposals, their blocks, the
prefix cache), with outputs compared against runs without speculation."""

from __future__ import annotations

import asyncio
import zlib
from array import array
from collections.abc import Sequence

import pytest

from engine.contract import SamplingParams
from scheduler.block_allocator import blocks_for_tokens, hash_block
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.fake_runner import FakeDetokenizer, FakeRunner, hash_next_token, mostly_right_draft
from scheduler.loop import IterationLoop
from scheduler.output_text import start_output
from scheduler.outputs import StepReport
from scheduler.request import Request, RequestStatus
from scheduler.speculation import (
    PRIOR_ACCEPTANCE,
    AcceptanceTable,
    NgramIndex,
    Proposal,
    SpeculationPolicy,
)

DETOK = FakeDetokenizer()
GUARD_S = 20


def quoting_model(context: Sequence[int]) -> int:
    """A fake model that rewrites its prompt: it copies the prompt's body (after its first token, the
    prompt's length) from the start, over and over, and one time in five says a token of its own
    instead, an edit, after which the copy goes on where it was."""
    if zlib.crc32(array("q", context).tobytes()) % 5 == 0:
        return hash_next_token(context)
    n = context[0]
    return context[1 + (len(context) - n) % (n - 1)]


def text_prompt(seed: int, n: int = 24) -> list[int]:
    """A prompt for the quoting model: its length, then tokens of its own."""
    return [n, *(100 + (seed * 31 + i * 7) % 500 for i in range(n - 1))]


def make_request(rid: str, prompt: Sequence[int], **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **params})
    return Request(rid, prompt, sampling, output_text=start_output(DETOK, prompt, sampling))


def run(
    runner: FakeRunner, config: SchedulerConfig, requests: list[Request], check=None
) -> tuple[list[Request], Scheduler, int]:
    """Every request to its end, synchronously; `check(sched)` after every update."""
    sched = Scheduler.for_executor(config, runner)
    for r in requests:
        sched.add(r)
    steps = 0
    while sched.has_work():
        step = sched.schedule()
        if step.seqs:
            sched.update(step, runner.step(step.seqs))
        if check is not None:
            check(sched)
        steps += 1
        assert steps < 5000, "no progress"
    return requests, sched, steps


def outputs(requests: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in requests]


# ---- the n-gram index --------------------------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3])
    # Suffix [1, 2, 3] occurred twice before; the latest one was followed by 5, 6, 7.
    assert index.propose(3) == (3, [5, 6, 7])
    assert index.propose(1) == (3, [5])
    index.extend([4])  # now [1, 2, 3, 4]'s only earlier occurrence is followed by 9
    assert index.propose(2) == (4, [9, 1])


def test_ngram_index_prefers_the_longest_match_and_needs_min_n():
    index = NgramIndex(2, 3)
    index.extend([7, 8, 1, 5, 8, 1, 6, 9, 8, 1])
    # [9, 8, 1] never occurred; [8, 1] did, latest before 6.
    assert index.propose(2) == (2, [6, 9])
    lone = NgramIndex(2, 3)
    lone.extend([4, 5, 6, 4])  # only the single token 4 repeats: below min_n
    assert lone.propose(3) == (0, [])
    assert NgramIndex(1, 3).propose(3) == (0, [])
    one = NgramIndex(1, 3)
    one.extend([4, 5, 6, 4])
    assert one.propose(3) == (1, [5, 6, 4])


def test_ngram_index_continues_a_loop_past_its_own_end():
    index = NgramIndex(2, 4)
    index.extend([3, 1, 2, 1, 2])
    # [1, 2] last occurred at 1..2, followed by [1, 2]: the loop goes on with period 2.
    assert index.propose(5) == (2, [1, 2, 1, 2, 1])


# ---- the policy ----------------------------------------------------------------------------------


def decoding(prompt: Sequence[int], outputs: Sequence[int] = (), **params) -> Request:
    r = make_request("x", prompt, **params)
    r.output_token_ids.extend(outputs)
    return r


def test_acceptance_is_learnt_by_kind_of_proposal_and_follows_recent_verifications():
    table = AcceptanceTable()
    short, long = (1, "zero"), (4, "full")
    assert table.rate(short) == table.rate(long) == pytest.approx(PRIOR_ACCEPTANCE)
    for _ in range(20):
        table.record(short, 4, 0)
        table.record(long, 4, 4)
    assert table.rate(short) < 0.1 and table.rate(long) > 0.95
    for _ in range(200):  # the workload changes: a short match is now as good as any
        table.record(short, 4, 4)
    assert table.rate(short) > 0.9


def test_policy_turns_speculation_down_as_the_batch_grows_and_off_past_max_batch():
    per_request = []
    for b in (1, 2, 4, 8, 9):
        policy = SpeculationPolicy("draft", max_tokens=4, max_batch=8, token_cost=0.1)
        for _ in range(10):
            policy.acceptance.record((0, "none"), 4, 3)
        reqs = [decoding([1, 2, 3]) for _ in range(b)]
        plan = policy.plan(reqs, spare=1000, max_model_len=100)
        per_request.append(sum(p.count for p in plan.values()) / b)
    assert per_request[0] > 0 and per_request[-1] == 0
    assert per_request == sorted(per_request, reverse=True)


def test_rows_that_cannot_propose_count_in_the_batch():
    """Under overlapped scheduling most decodes of a large batch are carried (they cannot propose): the
    few that can must not propose as if they were the whole batch."""
    policy = SpeculationPolicy("draft", max_tokens=4, max_batch=8, token_cost=0.1)
    for _ in range(10):
        policy.acceptance.record((0, "none"), 4, 3)
    reqs = [decoding([1, 2, 3]) for _ in range(2)]
    assert policy.plan(reqs, spare=1000, max_model_len=100)
    assert policy.plan(reqs, spare=1000, max_model_len=100, batch=32) == {}
    alone = sum(p.count for p in policy.plan(reqs, 1000, 100).values())
    assert sum(p.count for p in policy.plan(reqs, 1000, 100, batch=6).values()) < alone


def test_policy_follows_acceptance_and_stays_within_the_budget():
    """A request whose last proposal was all accepted proposes more than one whose last was rejected at
    once, as the table has learnt; and the budget caps them together."""
    policy = SpeculationPolicy("draft", max_tokens=8, max_batch=8, token_cost=0.1)
    good, poor = decoding([1, 2, 3]), decoding([1, 2, 3])
    for _ in range(10):
        policy.plan([good, poor], spare=1000, max_model_len=100)
        policy.record(good, 4, 4)
        policy.record(poor, 4, 0)
    assert (good.spec.last, poor.spec.last) == ("full", "zero")
    plan = policy.plan([good, poor], spare=1000, max_model_len=100)
    assert plan[0].count > plan.get(1, Proposal(0)).count
    assert sum(p.count for p in policy.plan([good, poor], spare=3, max_model_len=100).values()) == 3


def test_policy_never_proposes_past_max_tokens_or_the_maximum_length():
    policy = SpeculationPolicy("draft", max_tokens=4, max_batch=8, token_cost=0.01)
    near_max_tokens = decoding([1, 2, 3], [5] * 8, max_tokens=10)  # 2 tokens left: 1 proposal
    assert policy.plan([near_max_tokens], 1000, 100)[0].count == 1
    last = decoding([1, 2, 3], [5] * 9, max_tokens=10)  # 1 token left: nothing to propose
    assert policy.plan([last], 1000, 100) == {}
    near_end = decoding([1, 2, 3], [5, 5], max_tokens=50)  # 5 tokens: positions up to 6 of max 7
    assert policy.plan([near_end], 1000, 7)[0].count == 2


def test_ngram_policy_proposes_only_what_the_index_finds():
    policy = SpeculationPolicy("ngram", max_tokens=4, max_batch=8, token_cost=0.01)
    quoting = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    fresh = decoding([9, 8, 7, 6])
    plan = policy.plan([quoting, fresh], 1000, 100)
    assert plan == {0: Proposal(4, [3, 4, 5, 6])}
    assert quoting.spec.pending == (2, "none")  # filed under a 2-token match, for its verification


def test_scheduler_refuses_draft_speculation_without_a_draft_model():
    with pytest.raises(ValueError, match="draft-model"):
        Scheduler.for_executor(SchedulerConfig(speculative="draft"), FakeRunner())
    # auto: the draft model where there is one, else n-gram
    assert Scheduler.for_executor(SchedulerConfig(), FakeRunner()).speculation.method == "ngram"
    with_draft = FakeRunner(draft_fn=mostly_right_draft)
    assert Scheduler.for_executor(SchedulerConfig(), with_draft).speculation.method == "draft"
    assert Scheduler.for_executor(SchedulerConfig(speculative="off"), with_draft).speculation is None


# ---- lossless: the same tokens with and without speculation ------------------------------------


def quoting_runner(**kw) -> FakeRunner:
    return FakeRunner(token_fn=quoting_model, **kw)


def speculating_runner(method: str, **kw) -> FakeRunner:
    """ngram: the quoting model, whose outputs repeat its prompt; draft: a draft that is right three
    times in four for the hash model."""
    if method == "ngram":
        return quoting_runner(**kw)
    return FakeRunner(draft_fn=mostly_right_draft, **kw)


SCENARIOS = {
    "alone": (dict(), 1),
    "batched": (dict(max_num_seqs=6), 5),
    "chunked prefill": (dict(max_num_seqs=4, max_num_batched_tokens=9), 3),
    "preemption": (dict(max_num_seqs=4), 4),  # with a cache too small for all of them
    "reserve": (dict(max_num_seqs=3, kv_policy="reserve"), 3),
    "request batching": (dict(max_num_seqs=3, scheduling="request", kv_policy="reserve"), 3),
    "no prefix caching": (dict(max_num_seqs=3, enable_prefix_caching=False), 3),
}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_tokens_with_and_without_speculation(method, scenario):
    cfg, n = SCENARIOS[scenario]
    blocks = 14 if scenario == "preemption" else 128

    def requests() -> list[Request]:
        return [make_request(f"r{i}", text_prompt(i), max_tokens=20 + 3 * i) for i in range(n)]

    plain, _, plain_steps = run(
        speculating_runner(method, num_kv_blocks=blocks),
        SchedulerConfig(**cfg, speculative="off"),
        requests(),
    )
    spec, sched, spec_steps = run(
        speculating_runner(method, num_kv_blocks=blocks),
        SchedulerConfig(**cfg, speculative=method),
        requests(),
    )
    assert outputs(spec) == outputs(plain)
    stats = sched.stats().speculation
    assert stats.accepted_tokens > 0 and spec_steps < plain_steps
    if scenario == "preemption":
        assert sched.num_preemptions > 0
    assert sched.allocator.num_used == 0


def test_prefix_caching_reuses_only_accepted_tokens():
    """A second request whose prompt is the first one's prompt + outputs takes the first one's blocks
    from the cache; the fake runner checks every slot it reads against its own context, so a cached
    block holding a rejected proposal would fail it."""
    runner = quoting_runner(num_kv_blocks=64)
    (first,), sched, _ = run(runner, SchedulerConfig(), [make_request("a", text_prompt(3), max_tokens=40)])
    assert sched.stats().speculation.proposed_tokens > sched.stats().speculation.accepted_tokens > 0
    follow_up = [*first.prompt_token_ids, *first.output_token_ids, 77]
    sched.add(make_request("b", follow_up, max_tokens=12))
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, runner.step(step.seqs))
    assert sched.requests == {} and sched.prefix_cache_stats().hits >= len(follow_up) - 4 - 1


def accepted_block_names(req: Request, block_size: int) -> list[bytes]:
    """The names of the request's full blocks of computed (accepted) tokens, from scratch."""
    names: list[bytes] = []
    for i in range(req.num_computed_tokens // block_size):
        names.append(
            hash_block(names[-1] if names else None, req.token_slice(i * block_size, (i + 1) * block_size))
        )
    return names


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rollback_keeps_the_books(method):
    """After every step: a running request has computed all its tokens but the last (rejected
    proposals rolled back), holds blocks for its tokens only, and every named block in its table is
    named after its accepted tokens."""
    runner = speculating_runner(method, num_kv_blocks=64)
    bs = runner.block_size
    verifications = 0

    def check(sched: Scheduler) -> None:
        nonlocal verifications
        verifications = sched.stats().speculation.num_verifications
        for r in sched.running:
            if r.num_output_tokens == 0:
                continue
            assert r.num_computed_tokens == r.num_tokens - 1
            bounds = (blocks_for_tokens(r.num_computed_tokens, bs), blocks_for_tokens(r.num_tokens, bs))
            assert bounds[0] <= len(r.block_ids) <= bounds[1]
            names = accepted_block_names(r, bs)
            for i, block in enumerate(r.block_ids):
                name = sched.allocator.block_hash(block)
                assert name is None or name == names[i]

    reqs = [make_request(f"r{i}", text_prompt(i), max_tokens=30) for i in range(3)]
    run(runner, SchedulerConfig(max_num_seqs=4), reqs, check)
    assert verifications > 0


def test_proposals_take_only_blocks_nobody_else_needs():
    """Two decoding requests, two free blocks: each one's own token takes one; no proposal may take a
    block and leave the other to be preempted (proposals come last, from what is free, cut to fit)."""
    runner = FakeRunner(num_kv_blocks=6, draft_fn=mostly_right_draft)
    sched = Scheduler.for_executor(SchedulerConfig(num_speculative_tokens=4), runner)
    a, b = (make_request(r, text_prompt(i, n=8), max_tokens=12) for i, r in enumerate("ab"))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()  # both 8-token prompts: 2 blocks of 4 each
    sched.update(step, runner.step(step.seqs))
    for _ in range(10):  # make proposals look worth their cost
        sched.speculation.acceptance.record((0, "none"), 4, 4)
    step = sched.schedule()
    assert not step.preempted and sched.allocator.num_free == 0
    # a's 4 proposals cut to the 3 its new block holds; b's (fewer: it has no history yet) fit too
    assert step.seqs[0].num_spec_tokens == 3 and step.seqs[1].num_spec_tokens <= 3
    sched.update(step, runner.step(step.seqs))


def test_a_stop_inside_an_accepted_run_drops_what_follows():
    """The step that accepts proposals past a stop string (or EOS) ends the request at the stop: the
    tokens after it are dropped, exactly as without speculation."""
    probe = make_request("probe", text_prompt(1), max_tokens=30)
    run(quoting_runner(), SchedulerConfig(speculative="off"), [probe])
    stop_token = probe.output_token_ids[12]
    stop = DETOK.text(stop_token)
    results = []
    for method in ("off", "ngram"):
        r = make_request("a", text_prompt(1), max_tokens=30, stop=(stop,))
        eos = make_request("b", text_prompt(1), max_tokens=30, ignore_eos=False, stop_token_ids=(stop_token,))
        _, sched, _ = run(quoting_runner(), SchedulerConfig(speculative=method), [r, eos])
        results.append([(x.output_token_ids, x.status, x.output_text.take()[0]) for x in (r, eos)])
    assert results[0] == results[1]
    (tokens, status, _), _ = results[1]
    assert status is RequestStatus.FINISHED_STOPPED and tokens.index(stop_token) == len(tokens) - 1


def test_logprobs_come_with_every_accepted_token():
    plain = make_request("a", text_prompt(2), max_tokens=25, logprobs=2)
    spec = make_request("a", text_prompt(2), max_tokens=25, logprobs=2)
    run(quoting_runner(), SchedulerConfig(speculative="off"), [plain])
    _, sched, _ = run(quoting_runner(), SchedulerConfig(), [spec])
    assert sched.stats().speculation.accepted_tokens > 0
    a, b = plain.output_text.take()[1], spec.output_text.take()[1]
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in a] == [
        (t.token_id, t.logprob, t.top_logprobs) for t in b
    ]
    assert len(b) == 25


@pytest.mark.usefixtures("both_overlap_modes")
async def test_the_loop_reports_acceptance_and_keeps_pipelined_batches_right():
    """Through the iteration loop, pipeline depth 2 included: the same tokens, and every step report
    says what was proposed and accepted, request by request."""
    results = {}
    reports: list[StepReport] = []
    for depth, method in ((1, "off"), (1, "ngram"), (2, "ngram")):
        loop = IterationLoop(quoting_runner(pipeline_depth=depth), SchedulerConfig(speculative=method))
        if method != "off" and depth == 1:
            loop.add_step_listener(reports.append)
        await loop.start()
        try:
            streams = [
                loop.generate(text_prompt(i), SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
                for i in range(3)
            ]

            async def tokens(stream) -> list[int]:
                return [t async for d in stream for t in d.token_ids]

            results[depth, method] = await asyncio.wait_for(asyncio.gather(*map(tokens, streams)), GUARD_S)
            stats = loop.stats().speculation
        finally:
            await loop.shutdown()
        if method != "off":
            assert stats.accepted_tokens > 0
    assert results[1, "ngram"] == results[1, "off"] == results[2, "ngram"]
    assert sum(r.num_spec_accepted for r in reports) > 0
    for r in reports:
        assert r.num_spec_proposed == sum(r.request_num_proposed)
        assert r.num_spec_accepted == sum(r.request_num_accepted)
        assert all(a <= p for a, p in zip(r.request_num_accepted, r.request_num_proposed, strict=True))
        assert r.num_tokens == r.num_prompt_tokens + r.num_decode_tokens + r.num_spec_proposed
