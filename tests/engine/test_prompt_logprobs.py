"""Prompt logprobs against transformers: the scheduler scores a prompt chunk by chunk (chunked prefill
splits it across steps, next to other requests that score nothing), and every prompt token but the
first gets the log-softmax of the model's logits at the position before it, its rank and the top-k."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_parity import hf_logits, hf_model, make_runner

from engine.contract import PromptLogprobs, SamplingParams, ScheduledSequence
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop

PROMPT = [7, 99, 3, 250, 18, 41, 5, 300, 12, 77, 6, 150, 9, 2, 64, 33, 21]


def expected(model_dir: Path, prompt: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    logprobs = torch.log_softmax(hf_logits(hf_model(model_dir), prompt), dim=-1)  # [n, V]
    out = []
    for pos in range(len(prompt) - 1):
        row, token = logprobs[pos], prompt[pos + 1]
        rank = int((row > row[token]).sum()) + 1
        out.append((float(row[token]), rank, row.topk(k).indices.tolist()))
    return out


async def run_loop(runner, requests: dict[str, tuple[list[int], SamplingParams]], budget: int):
    engine = IterationLoop(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    try:

        async def one(rid: str, prompt: list[int], params: SamplingParams):
            return [d async for d in engine.generate(prompt, params, rid)]

        results = await asyncio.gather(*(one(r, p, s) for r, (p, s) in requests.items()))
        return dict(zip(requests, results, strict=True))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("budget", [64, 6], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir: Path, budget: int) -> None:
    runner = make_runner(tiny_llama_dir)
    scoring = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    deltas = asyncio.run(
        run_loop(runner, {"scored": (PROMPT, scoring), "other": (PROMPT[:9], plain)}, budget)
    )
    first = deltas["scored"][0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPT)
    assert first.prompt_logprobs[0] is None  # nothing precedes the first token
    want = expected(tiny_llama_dir, PROMPT, 2)
    for got, (lp, rank, top) in zip(first.prompt_logprobs[1:], want, strict=True):
        assert got is not None
        assert got.logprob == pytest.approx(lp, abs=1e-4)
        assert got.rank == rank
        assert [t for t, _ in got.top_logprobs] == top
    assert all(d.prompt_logprobs is None for d in deltas["scored"][1:])
    assert all(d.prompt_logprobs is None for d in deltas["other"])
    # Scoring the prompt changes nothing about the tokens generated after it.
    assert [t for d in deltas["scored"] for t in d.token_ids] == [
        t
        for d in asyncio.run(run_loop(make_runner(tiny_llama_dir), {"p": (PROMPT, plain)}, budget))["p"]
        for t in d.token_ids
    ]


def test_a_chunk_that_scores_but_does_not_sample(tiny_llama_dir: Path) -> None:
    """The executor's own contract: a middle chunk returns PromptLogprobs, the last chunk a token that
    carries the rest."""
    runner = make_runner(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, prompt_logprobs=0)
    head = ScheduledSequence("a", PROMPT[:8], 0, [0, 1], False, params, PROMPT, [], num_prompt_scored=8)
    [scored] = runner.step([head])
    assert isinstance(scored, PromptLogprobs) and len(scored.logprobs) == 8
    assert scored.top_logprobs == [[] for _ in range(8)]
    tail = ScheduledSequence(
        "a", PROMPT[8:], 8, [0, 1, 2, 3, 4], True, params, PROMPT, [], num_prompt_scored=len(PROMPT) - 9
    )
    [tok] = runner.step([tail])
    assert tok is not None and not isinstance(tok, PromptLogprobs)
    assert tok.prompt_logprobs is not None and len(tok.prompt_logprobs.logprobs) == len(PROMPT) - 9
    want = expected(tiny_llama_dir, PROMPT, 1)
    got = scored.logprobs + tok.prompt_logprobs.logprobs
    assert got == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
