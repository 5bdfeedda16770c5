"""Embeddings against transformers: an embedding request runs its prompt through the same steps as
generation (whole, or chunk by chunk next to other requests), and its pooled final hidden states
(after the final norm, before the LM head) match a direct float32 forward pass of the HF model with
the same pooling. The same input gives the same vector alone and batched with generation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_parity import hf_model, make_runner

from engine.contract import Pooling, SamplingParams, ScheduledSequence
from engine.inputs import PoolSpan
from engine.pooling import pool_hidden
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from scheduler.outputs import RequestDelta

PROMPT = [7, 99, 3, 250, 18, 41, 5, 300, 12, 77, 6, 150, 9, 2, 64, 33, 21]
OTHER = [5, 17, 230, 48, 11, 3]


def hf_embedding(model_dir: Path, tokens: list[int], pooling: Pooling) -> torch.Tensor:
    """transformers' float32 pooling of the final norm's output (its last_hidden_state)."""
    hf = hf_model(model_dir)
    with torch.inference_mode():
        states = hf.model(torch.tensor([tokens])).last_hidden_state[0].float()  # [n, hidden]
    if pooling == "mean":
        return states.mean(dim=0)
    return states[-1] if pooling == "last" else states[0]


async def run(runner, budget: int, embed: dict[str, tuple[list[int], Pooling]], generate: list[list[int]]):
    """Embeddings (and greedy generations beside them) through one IterationLoop."""
    engine = IterationLoop(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def one_embedding(rid: str, tokens: list[int], pooling: Pooling) -> list[float]:
        [delta] = [d async for d in engine.embed(tokens, pooling, rid)]
        assert delta.error is None and delta.embedding is not None
        return delta.embedding

    async def one_generation(i: int, tokens: list[int]) -> list[int]:
        return [t async for d in engine.generate(tokens, params, f"g{i}") for t in d.token_ids]

    try:
        jobs = [one_embedding(r, t, p) for r, (t, p) in embed.items()]
        jobs += [one_generation(i, t) for i, t in enumerate(generate)]
        results = await asyncio.gather(*jobs)
        assert engine.stats().kv_blocks_used == 0  # every block back, the embeddings' included
        return dict(zip(embed, results[: len(embed)], strict=True)), results[len(embed) :]
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("budget", [64, 6], ids=["whole", "chunked"])
@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_embeddings_match_transformers(request, family: str, budget: int) -> None:
    model_dir = request.getfixturevalue(family)
    runner = make_runner(model_dir)
    requests: dict[str, tuple[list[int], Pooling]] = {p: (PROMPT, p) for p in ("last", "mean", "cls")}
    got, _ = asyncio.run(run(runner, budget, requests, []))
    for pooling in ("last", "mean", "cls"):
        want = hf_embedding(model_dir, PROMPT, pooling)
        torch.testing.assert_close(torch.tensor(got[pooling]), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [64, 6], ids=["whole", "chunked"])
def test_alone_and_batched_with_generation_give_the_same_embedding(tiny_llama_dir: Path, budget: int) -> None:
    requests: dict[str, tuple[list[int], Pooling]] = {"last": (PROMPT, "last"), "mean": (PROMPT, "mean")}
    alone, _ = asyncio.run(run(make_runner(tiny_llama_dir), budget, requests, []))
    generations = [OTHER, PROMPT[:9]]
    batched, tokens = asyncio.run(run(make_runner(tiny_llama_dir), budget, requests, generations))
    solo = [asyncio.run(run(make_runner(tiny_llama_dir), budget, {}, [g]))[1][0] for g in generations]
    assert tokens == solo  # the embeddings changed nothing of the generations beside them
    for pooling in ("last", "mean"):
        assert batched[pooling] == alone[pooling], pooling


def test_a_step_with_an_embedding_and_a_sampled_token(tiny_llama_dir: Path) -> None:
    """The executor's own contract: one step holds a sampling entry and an embedding entry; the first
    gets its token, the second its PooledState (its chunk's sum for "mean")."""
    runner = make_runner(tiny_llama_dir)
    greedy = SamplingParams(temperature=0.0)
    gen = ScheduledSequence("g", OTHER, 0, [0, 1], True, greedy, OTHER, [])
    emb = ScheduledSequence("e", PROMPT[:8], 0, [2, 3], False, pooling="mean")
    token, pooled = runner.step([gen, emb])
    assert token is not None and not hasattr(token, "values")
    assert pooled is not None and pooled.num_tokens == 8
    want = hf_embedding(tiny_llama_dir, PROMPT[:8], "mean") * 8
    torch.testing.assert_close(torch.tensor(pooled.values), want, atol=1e-4, rtol=1e-4)


def test_pool_hidden_per_span() -> None:
    hidden = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    spans = [PoolSpan(0, 0, 3, "mean"), PoolSpan(1, 3, 3, "last"), PoolSpan(2, 3, 3, "cls")]
    pooled = pool_hidden(hidden, spans)
    assert pooled.dtype == torch.float32
    assert pooled.tolist() == [[6.0, 9.0], [10.0, 11.0], [6.0, 7.0]]


def test_last_token_pooling_takes_the_prompt_from_the_prefix_cache(tiny_llama_dir: Path) -> None:
    """The second time a prompt comes, "last" pooling computes only its last block (the cache holds
    the rest) and gives the same vector; "mean" and "cls" need every state, so they compute all."""
    prompt = [*PROMPT, 40]  # 18 tokens: the cache may hold the first 16 (never the last two)

    async def twice(pooling: Pooling) -> list[RequestDelta]:
        engine = IterationLoop(make_runner(tiny_llama_dir), SchedulerConfig(max_num_seqs=4))
        try:
            out = []
            for i in range(2):  # one after the other: the second finds the first's blocks cached
                out.append([d async for d in engine.embed(prompt, pooling, f"{pooling}-{i}")][-1])
            return out
        finally:
            await engine.shutdown()

    for pooling in ("last", "mean", "cls"):
        first, second = asyncio.run(twice(pooling))
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == (16 if pooling == "last" else 0)
        torch.testing.assert_close(
            torch.tensor(second.embedding), torch.tensor(first.embedding), atol=1e-5, rtol=1e-5
        )
