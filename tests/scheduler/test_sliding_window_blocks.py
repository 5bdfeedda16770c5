"""A model whose every layer has a sliding window (Executor.kv_window) reads no key behind it, so the
scheduler gives those KV blocks back as a request moves on (scheduler.policy.KVPolicy
.release_behind_window): a long generation holds a window's worth of blocks, not its whole history,
and its tokens do not change. The fake runner reads back every key the windows reach and checks it
is the request's own."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fakes import greedy_through_loop

from engine.contract import SamplingParams
from scheduler.block_allocator import blocks_for_tokens
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.fake_runner import FakeRunner, hash_next_token
from scheduler.request import Request

BS = 4
WINDOW = 6


def expected_outputs(prompt: Sequence[int], n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context.append(hash_next_token(context))
    return context[len(prompt) :]


def request(rid: str, prompt: Sequence[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def most_blocks_held(sched: Scheduler, runner: FakeRunner) -> int:
    """Run the scheduler dry; the most blocks held after any step."""
    most = 0
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, runner.step(step.seqs))
        most = max(most, sched.allocator.num_used)
    return most


@pytest.mark.parametrize("kv_policy", ["lazy", "reserve"])
def test_a_long_generation_holds_a_window_of_blocks_and_its_tokens(kv_policy: str) -> None:
    runner = FakeRunner(num_kv_blocks=64, block_size=BS, max_model_len=256, kv_window=WINDOW)
    sched = Scheduler.for_executor(
        SchedulerConfig(kv_policy=kv_policy, max_num_seqs=4, max_num_batched_tokens=8, speculative="off"),
        runner,
    )
    prompt = list(range(100, 130))  # 30 tokens: in chunks of 8, each chunk's window reaches back 5
    req = request("a", prompt, max_tokens=60)
    sched.add(req)
    most = most_blocks_held(sched, runner)
    assert req.output_token_ids == expected_outputs(prompt, 60)
    if kv_policy == "lazy":
        # The window (6 keys) and a chunk of 8 new tokens span at most 4 blocks of 4, one more where
        # they straddle a boundary; 90 tokens would take 23.
        assert most <= blocks_for_tokens(WINDOW - 1 + 8, BS) + 1
    else:  # reserve holds the blocks of every token still to come, and gives back those behind
        assert most <= blocks_for_tokens(90, BS)
    assert sched.allocator.num_used == 0


def test_without_a_window_every_block_stays() -> None:
    runner = FakeRunner(num_kv_blocks=64, block_size=BS, max_model_len=256)
    sched = Scheduler.for_executor(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, speculative="off"), runner
    )
    sched.add(request("a", list(range(100, 130)), max_tokens=60))
    # 88 tokens' K/V before the last step, which gives everything back as the request finishes
    assert most_blocks_held(sched, runner) == blocks_for_tokens(88, BS)


def test_given_back_blocks_serve_other_requests() -> None:
    """A cache of 12 blocks (48 tokens) runs three requests of 46 tokens each at once, none preempted."""
    runner = FakeRunner(num_kv_blocks=12, block_size=BS, max_model_len=48, kv_window=WINDOW)
    sched = Scheduler.for_executor(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=12, speculative="off"), runner
    )
    prompts = [[200 + 7 * r + i for i in range(20)] for r in range(3)]
    reqs = [request(f"r{i}", p, max_tokens=26) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    assert most_blocks_held(sched, runner) <= 12 and sched.num_preemptions == 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == expected_outputs(p, 26)


def test_given_back_blocks_stay_cached_as_a_prefix() -> None:
    """With prefix caching, a block given back keeps its name (the pool evicts it only when its memory
    is needed): the same prompt again starts from it."""
    runner = FakeRunner(num_kv_blocks=64, block_size=BS, max_model_len=256, kv_window=WINDOW)
    sched = Scheduler.for_executor(SchedulerConfig(enable_prefix_caching=True, speculative="off"), runner)
    prompt = list(range(500, 520))
    first = request("first", prompt, max_tokens=30)
    sched.add(first)
    most_blocks_held(sched, runner)
    assert first.num_released_blocks == 0  # released with the rest when it finished
    again = request("again", prompt, max_tokens=30)
    sched.add(again)
    most_blocks_held(sched, runner)
    assert again.num_cached_tokens == 16  # the 4 full blocks before the last two prompt tokens
    assert again.output_token_ids == first.output_token_ids == expected_outputs(prompt, 30)


async def test_the_loop_with_overlap_and_a_window_gives_the_same_tokens() -> None:
    """Overlapped scheduling queues a step before the last one's tokens are applied: blocks go back
    only once K/V exist, and behind every query the steps in flight still make."""
    runner = FakeRunner(num_kv_blocks=16, block_size=BS, max_model_len=64, kv_window=WINDOW)
    prompts = [[300 + 11 * r + i for i in range(9 + 4 * r)] for r in range(3)]
    got = await greedy_through_loop(runner, prompts, 40, SchedulerConfig(overlap_schedule=True))
    assert got == [expected_outputs(p, 40) for p in prompts]
