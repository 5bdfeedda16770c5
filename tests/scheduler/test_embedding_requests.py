"""Embedding requests in the iteration loop (IterationLoop.embed) with the fake runner: prefill-only
work batched with generation, pooled over every chunk of a chunked prompt, finished with their prompt
(their KV blocks freed), and never changing what shares the batch.

The fake runner's hidden state at a position is a function of the context through it, read back from
its simulated KV cache, so a chunk that reads the wrong K/V pools something else."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_loop import GUARD_S, collect, expected_outputs, in_thread_wait, prompt
from test_scheduler import pooled as expected
from waiting import wait_until

from engine.contract import Pooling, SamplingParams
from scheduler.fake_runner import FakeRunner
from scheduler.outputs import FinishReason, RequestDelta

# Embeddings in the overlapped loop too: a carried prompt chunk of an embedding pools, never samples.
pytestmark = pytest.mark.usefixtures("both_overlap_modes")


async def embed_one(engine, tokens: list[int], pooling: Pooling, rid: str) -> RequestDelta:
    [delta] = await collect(engine.embed(tokens, pooling, rid))
    return delta


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("budget", [512, 5], ids=["whole", "chunked"])
async def test_embedding_pools_the_whole_prompt(make_engine, pooling: Pooling, budget: int) -> None:
    runner = FakeRunner()
    engine = await make_engine(runner, max_num_batched_tokens=budget, max_num_seqs=4)
    tokens = prompt(23)
    delta = await embed_one(engine, tokens, pooling, "e")
    assert delta.finish_reason is FinishReason.STOP and delta.error is None
    assert delta.token_ids == [] and delta.num_prompt_tokens == 23 and delta.num_output_tokens == 0
    assert delta.embedding == pytest.approx(expected(runner, tokens, pooling), abs=1e-12)
    if budget == 5:  # every chunk pooled, never sampled
        chunks = [r for step in runner.history for r in step if r.request_id == "e"]
        assert len(chunks) == 5 and not any(r.sample for r in chunks)
    assert engine.stats().kv_blocks_used == 0


async def generate_greedy(engine, tokens: list[int], n: int, rid: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for d in await collect(engine.generate(tokens, params, rid)) for t in d.token_ids]


@pytest.mark.parametrize("budget", [512, 7], ids=["whole", "chunked"])
async def test_alone_and_batched_with_generation_give_the_same_embedding(make_engine, budget: int) -> None:
    alone_engine = await make_engine(FakeRunner(), max_num_batched_tokens=budget, max_num_seqs=4)
    alone = {p: await embed_one(alone_engine, prompt(19, 3), p, f"alone-{p}") for p in ("last", "mean")}

    runner = FakeRunner()
    engine = await make_engine(runner, max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = [prompt(9 + i, i) for i in range(3)]
    generating = asyncio.gather(*(generate_greedy(engine, p, 12, f"g{i}") for i, p in enumerate(prompts)))
    batched = await asyncio.gather(*(embed_one(engine, prompt(19, 3), p, f"b-{p}") for p in ("last", "mean")))
    outputs = await asyncio.wait_for(generating, GUARD_S)
    for delta, pooling in zip(batched, ("last", "mean"), strict=True):
        if budget == 512 or pooling == "last":  # the same positions give the same states: exactly
            assert delta.embedding == alone[pooling].embedding
        else:  # the batch moved the chunk boundaries: the chunks' sums add up in another order
            assert delta.embedding == pytest.approx(alone[pooling].embedding, rel=1e-12)
    # ... and the generations are those of requests running alone.
    assert outputs == [expected_outputs(p, 12) for p in prompts]
    # They did share steps with the generations.
    assert any({"b-mean", "g0"} <= {r.request_id for r in step} for step in runner.history)
    assert engine.stats().kv_blocks_used == 0


async def test_an_embedding_shares_steps_with_decodes(make_engine) -> None:
    runner = FakeRunner()
    engine = await make_engine(runner)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = engine.generate(prompt(6), params, "g")
    first = await asyncio.wait_for(anext(stream), GUARD_S)  # "g" is decoding now
    assert first.token_ids
    await embed_one(engine, prompt(30, 1), "mean", "e")
    rest = await collect(stream)
    assert rest[-1].finish_reason is FinishReason.LENGTH
    steps_with_both = [s for s in runner.history if {r.request_id for r in s} == {"g", "e"}]
    assert steps_with_both and all(
        next(r for r in s if r.request_id == "g").num_tokens == 1 for s in steps_with_both
    )


async def test_bad_embedding_requests_are_refused_at_once(make_engine) -> None:
    engine = await make_engine(FakeRunner(max_model_len=64))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.embed([], "last", "empty")
    with pytest.raises(
        ValueError, match=r"input \(65 tokens\) exceeds the model's maximum context length \(64"
    ):
        engine.embed(prompt(65), "last", "long")
    # The whole context is the limit: no room is kept for output tokens.
    assert (await embed_one(engine, prompt(64), "last", "full")).finish_reason is FinishReason.STOP
    with pytest.raises(ValueError, match="out of range"):
        engine.embed([10**9], "last", "bad-id")
    assert engine.stats().kv_blocks_used == 0 and engine.stats().waiting == 0


async def test_an_aborted_embedding_frees_its_blocks(make_engine) -> None:
    runner = FakeRunner(gate=threading.Event())
    engine = await make_engine(runner, max_num_batched_tokens=8, max_num_seqs=4)
    stream = engine.embed(prompt(40), "mean", "e")
    reading = asyncio.create_task(anext(stream))
    await in_thread_wait(runner.step_started)  # its first chunk is in the worker thread
    reading.cancel()
    runner.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await stream.aclose()  # the client is gone: the request is aborted
    await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0)


async def test_a_preempted_embedding_is_recomputed_from_its_first_token(make_engine) -> None:
    """A generation and a long embedding in a cache that holds only one of them: the embedding, admitted
    last, is preempted mid-prompt and runs again from position 0, and its mean starts over (no chunk
    counted twice)."""
    runner = FakeRunner(num_kv_blocks=12, block_size=4, max_model_len=44)
    engine = await make_engine(runner, max_num_batched_tokens=8, max_num_seqs=4, kv_policy="lazy")
    tokens = prompt(40, 1)
    stream = engine.generate(prompt(8), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), "g")
    await asyncio.wait_for(anext(stream), GUARD_S)
    delta = await embed_one(engine, tokens, "mean", "e")
    await collect(stream)
    assert engine.stats().num_preemptions >= 1
    starts = [r.start_position for step in runner.history for r in step if r.request_id == "e"]
    assert starts.count(0) >= 2  # it ran from its first token again
    assert delta.embedding == pytest.approx(expected(runner, tokens, "mean"), abs=1e-12)
    assert engine.stats().kv_blocks_used == 0


async def test_an_embedding_under_request_level_batching(make_engine) -> None:
    """The FasterTransformer baseline (scheduling="request", which holds finished requests until their
    batch ends) serves embeddings too: the vector, the generation's tokens, every block free."""
    runner = FakeRunner()
    engine = await make_engine(runner, scheduling="request")
    generation = asyncio.ensure_future(generate_greedy(engine, prompt(5), 8, "g"))
    delta = await embed_one(engine, prompt(12), "last", "e")
    assert (await asyncio.wait_for(generation, GUARD_S)) == expected_outputs(prompt(5), 8)
    assert delta.embedding == expected(runner, prompt(12), "last")
    assert engine.stats().kv_blocks_used == 0
