"""server.live_feed: the loop's listener only appends; one sender task encodes once per interval for all
viewers, samples when the loop outruns it, and drops a slow viewer's oldest messages instead of waiting."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from waiting import wait_until

from scheduler.outputs import StepReport
from server.live_feed import FeedLimits, IterationFeed, step_event


def report(step: int, ids: tuple[str, ...] = ("r",), finished: tuple[str, ...] = ()) -> StepReport:
    return StepReport(
        num_seqs=len(ids),
        num_tokens=len(ids),
        num_prompt_tokens=0,
        num_decode_tokens=len(ids),
        duration_s=0.002,
        step=step,
        request_ids=list(ids),
        request_num_tokens=[1] * len(ids),
        request_start_positions=[7] * len(ids),
        request_is_decode=[True] * len(ids),
        finished_ids=list(finished),
        kv_blocks_used=3,
        kv_blocks_total=64,
    )


async def next_message(stream) -> dict:
    return json.loads(await asyncio.wait_for(anext(stream), 10))


async def test_the_listener_only_keeps_a_bounded_history_while_nobody_watches():
    feed = IterationFeed(FeedLimits(history=8))
    for step in range(1, 21):
        feed.on_step(report(step))
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "orca-live-feed"]  # no sender task
    assert feed.messages_sent == 0 and feed.num_viewers == 0  # no JSON
    stream = feed.subscribe()
    backlog = await next_message(stream)
    assert [s["step"] for s in backlog["steps"]] == list(range(13, 21))  # the newest 8 kept
    await stream.aclose()


async def test_a_viewer_gets_the_backlog_then_each_interval_s_steps_in_one_message():
    feed = IterationFeed(FeedLimits(interval_s=0.01, backlog_steps=2))
    for step in (1, 2, 3):
        feed.on_step(report(step))
    stream = feed.subscribe()
    assert [s["step"] for s in (await next_message(stream))["steps"]] == [2, 3]
    for step in (4, 5, 6):
        feed.on_step(report(step, ids=("a", "b"), finished=("b",) if step == 6 else ()))
    message = await next_message(stream)
    assert [s["step"] for s in message["steps"]] == [4, 5, 6] and "gap" not in message
    last = message["steps"][-1]
    assert last == {
        "step": 6,
        "duration_ms": 2.0,
        "ids": ["a", "b"],
        "tokens": [1, 1],
        "starts": [7, 7],
        "decode": [True, True],
        "preempted": [],
        "finished": ["b"],
        "waiting": 0,
        "kv_used": 3,
        "kv_total": 64,
        "failed": False,
    }
    await stream.aclose()
    await wait_until(lambda: feed._sender is None)  # the last viewer gone: no task left running


def test_a_step_that_verified_proposals_says_what_each_request_proposed_and_kept():
    plain = step_event(report(1, ids=("a", "b")))
    assert "spec" not in plain and "accepted" not in plain  # no bytes for what did not happen
    spec = replace(
        report(2, ids=("a", "b")),
        num_spec_proposed=4,
        request_num_proposed=[4, 0],
        request_num_accepted=[3, 0],
    )
    event = step_event(spec)
    assert event["spec"] == [4, 0] and event["accepted"] == [3, 0]


async def test_more_steps_than_a_message_holds_are_sampled_into_a_gap():
    feed = IterationFeed(FeedLimits(interval_s=0.01, max_steps_per_message=4))
    stream = feed.subscribe()
    reader = asyncio.ensure_future(next_message(stream))
    await wait_until(lambda: feed.num_viewers == 1)
    for step in range(1, 11):  # ten steps within one interval
        feed.on_step(report(step, finished=("x",) if step == 2 else ()))
    message = await reader
    assert [s["step"] for s in message["steps"]] == [7, 8, 9, 10]
    assert message["gap"] == {"from": 1, "to": 6, "finished": ["x"], "preempted": []}
    await stream.aclose()


async def test_a_large_batch_sends_fewer_steps_per_message():
    feed = IterationFeed(FeedLimits(interval_s=0.01, max_entries_per_message=10))
    stream = feed.subscribe()
    reader = asyncio.ensure_future(next_message(stream))
    await wait_until(lambda: feed.num_viewers == 1)
    for step in range(1, 6):
        feed.on_step(report(step, ids=tuple(f"r{i}" for i in range(4))))
    message = await reader  # two steps of four fit in ten entries
    assert [s["step"] for s in message["steps"]] == [4, 5] and message["gap"]["to"] == 3
    await stream.aclose()


async def test_a_slow_viewer_loses_its_oldest_messages_and_holds_up_nobody():
    feed = IterationFeed(FeedLimits(interval_s=0.005, viewer_queue=3))
    slow, fast = feed.subscribe(), feed.subscribe()
    fast_reader = asyncio.ensure_future(next_message(fast))
    slow_first = asyncio.ensure_future(next_message(slow))  # registers the slow viewer
    await wait_until(lambda: feed.num_viewers == 2)
    seen: list[int] = []
    for step in range(1, 11):
        sent = feed.messages_sent
        feed.on_step(report(step))
        await wait_until(lambda sent=sent: feed.messages_sent > sent)  # one message per step
        message = await fast_reader
        seen += [s["step"] for s in message["steps"]]
        fast_reader = asyncio.ensure_future(next_message(fast))
    assert seen == list(range(1, 11))  # the fast viewer missed nothing
    # The slow one read its first message only; of the nine after it, the newest three wait for it.
    assert [s["step"] for s in (await slow_first)["steps"]] == [1]
    assert [(await next_message(slow))["steps"][0]["step"] for _ in range(3)] == [8, 9, 10]
    fast_reader.cancel()
    await asyncio.gather(fast_reader, return_exceptions=True)
    await slow.aclose()
    await fast.aclose()
    assert feed.num_viewers == 0


async def test_end_closes_every_stream():
    feed = IterationFeed(FeedLimits(interval_s=0.01))
    stream = feed.subscribe()
    reader = asyncio.ensure_future(anext(stream))
    await wait_until(lambda: feed.num_viewers == 1)
    feed.end()
    try:
        await asyncio.wait_for(reader, 10)
        raise AssertionError("the stream yielded after end()")
    except StopAsyncIteration:
        pass
    await feed.close()
