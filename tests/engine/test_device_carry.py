"""Tokens carried on the device (engine.contract.DeviceCarry): a step queued before the step before is
collected, its carried rows reading their tokens from that step's draws on the device.

On a CPU submit() is the forward itself, so nothing here overlaps; what runs is the same path a GPU
takes (the executor samples in submit(), the next step's input ids are written from the draws, eager,
through a decode graph (replayed by calling, fake_graphs) or with a prompt in the step), and its
tokens must be those of the step resolved on the host. The `cuda` test also checks that submitting
the carried step does not wait for the device.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fake_graphs import ReplayByCalling

from engine.config import EngineConfig
from engine.contract import (
    CARRIED_PLACEHOLDER,
    PENDING_TOKEN,
    DeviceCarry,
    SamplingParams,
    ScheduledSequence,
)
from engine.executor import LocalExecutor

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2, ignore_eos=True)
BLOCK_SIZE = 4
BLOCKS = 8  # a request's blocks: 32 tokens
PROMPTS = [list(range(100 + 10 * i, 105 + 10 * i)) for i in range(3)]
LATE_PROMPT = [900, 901, 902, 903]  # joins the carried step as a prompt (an eager step)


def executor(model_dir: Path, device: str = "cpu", graphs: bool = False) -> LocalExecutor:
    ex = LocalExecutor(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device=device,
            block_size=BLOCK_SIZE,
            num_kv_blocks=4 * BLOCKS,
            attention_backend="triton" if device == "cuda" else "cpu-decode",
            max_num_seqs=4,
            enforce_eager=device == "cpu",
        )
    )
    if graphs and device == "cpu":
        ex.runner.capture_decode_graphs(4, capturer=ReplayByCalling())
    return ex


def table(i: int) -> list[int]:
    return list(range(i * BLOCKS, (i + 1) * BLOCKS))


def prompts(params: SamplingParams) -> list[ScheduledSequence]:
    return [ScheduledSequence(str(i), p, 0, table(i), True, params) for i, p in enumerate(PROMPTS)]


def decodes(tokens: list[int], params: SamplingParams, outputs: list[list[int]]) -> list[ScheduledSequence]:
    return [
        ScheduledSequence(str(i), [t], len(PROMPTS[i]), table(i), True, params, PROMPTS[i], outputs[i])
        for i, t in enumerate(tokens)
    ]


def late_prompt() -> ScheduledSequence:
    return ScheduledSequence("late", LATE_PROMPT, 0, table(3), True, GREEDY)


def carried_step(ex: LocalExecutor, params: SamplingParams, with_prompt: bool) -> tuple[list, list]:
    """The prompts' step, then the decodes queued behind it with their tokens carried on the device;
    the results of both, collected after the second was submitted."""
    first = ex.submit(prompts(params))
    assert first.ahead is not None, "the executor did not sample in submit()"
    pending = decodes([PENDING_TOKEN] * 3, params, [[PENDING_TOKEN]] * 3)
    assert ex.carries(first, pending)
    batch = decodes([CARRIED_PLACEHOLDER] * 3, params, [[PENDING_TOKEN]] * 3)
    if with_prompt:
        batch = [batch[0], late_prompt(), *batch[1:]]  # a carried row after a prompt's four tokens
    rows = [0, 2, 3] if with_prompt else [0, 1, 2]
    second = ex.submit(batch, carry=DeviceCarry(first, rows))
    return ex.collect(first), ex.collect(second)


def resolved_on_the_host(ex: LocalExecutor, params: SamplingParams, with_prompt: bool) -> tuple[list, list]:
    first = ex.step(prompts(params))
    tokens = [t.token_id for t in first]
    batch = decodes(tokens, params, [[t] for t in tokens])
    if with_prompt:
        batch = [batch[0], late_prompt(), *batch[1:]]
    return first, ex.step(batch)


def logprobs(results: list) -> list[float]:
    """Each result's logprob and its top logprobs' values, flat (none for a greedy step)."""
    out: list[float] = []
    for r in results:
        if r.logprob is not None:
            out += [r.logprob, *(v for _, v in r.top_logprobs)]
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_step_carried_on_the_device_gives_the_tokens_resolved_on_the_host(
    tiny_llama_dir: Path, graphs: bool, params: SamplingParams
):
    ahead = executor(tiny_llama_dir, graphs=graphs)
    ahead.samples_ahead = True  # as on a GPU
    on_host = executor(tiny_llama_dir)
    for with_prompt in (False, True):
        got = carried_step(ahead, params, with_prompt)
        want = resolved_on_the_host(on_host, params, with_prompt)
        # The placeholder is not what the prompts drew: a step that ran it would show.
        assert all(t.token_id != CARRIED_PLACEHOLDER for t in want[0])
        # Tokens exactly; logprobs to float32 noise (a graph step pads its rows, and torch's matmul
        # can move a row by an ulp with the row count).
        for g, w in zip(got, want, strict=True):
            assert [t.token_id for t in g] == [t.token_id for t in w]
            assert logprobs(g) == pytest.approx(logprobs(w), abs=1e-5)


def test_rows_that_read_their_outputs_are_not_carried(tiny_llama_dir: Path):
    ex = executor(tiny_llama_dir)
    ex.samples_ahead = True
    first = ex.submit(prompts(GREEDY))
    pending = decodes([PENDING_TOKEN] * 3, GREEDY, [[PENDING_TOKEN]] * 3)
    assert ex.carries(first, pending)
    penalised = replace(pending[1], sampling=replace(GREEDY, repetition_penalty=1.2))
    assert not ex.carries(first, [pending[0], penalised, pending[2]])
    stranger = replace(pending[1], request_id="not in the step before")
    assert not ex.carries(first, [pending[0], stranger])
    ex.collect(first)

    ex.samples_ahead = False  # a CPU's default: sampled in collect(), nothing to carry from
    plain = ex.submit(prompts(GREEDY))
    assert plain.ahead is None and not ex.carries(plain, pending)
    ex.collect(plain)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_a_carried_step_is_queued_without_waiting_for_the_step_before(tiny_llama_dir: Path):
    ex = executor(tiny_llama_dir, device="cuda")
    assert ex.samples_ahead
    on_host = executor(tiny_llama_dir, device="cuda")
    want = resolved_on_the_host(on_host, GREEDY, with_prompt=False)
    first = ex.submit(prompts(GREEDY))
    batch = decodes([CARRIED_PLACEHOLDER] * 3, GREEDY, [[PENDING_TOKEN]] * 3)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            second = ex.submit(batch, carry=DeviceCarry(first, [0, 1, 2]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    assert syncs == 0, "submitting the carried step waited for the device"
    got = ex.collect(first), ex.collect(second)
    assert [[t.token_id for t in r] for r in got] == [[t.token_id for t in r] for r in want]


def test_an_embedding_entry_in_a_step_sampled_ahead_pools_the_same(tiny_llama_dir: Path):
    """Its pooled rows are copied to the host in submit() too (collect() must not wait for a step queued
    behind): the same values as a step sampled in collect()."""
    results = []
    for ahead in (True, False):
        ex = executor(tiny_llama_dir)
        ex.samples_ahead = ahead
        embedding = ScheduledSequence("e", LATE_PROMPT, 0, table(3), False, pooling="mean")
        handle = ex.submit([*prompts(GREEDY), embedding])
        assert (handle.pooled_copy is not None) is ahead
        results.append(ex.collect(handle))
    assert results[0] == results[1]
    assert results[0][-1].values and results[0][-1].num_tokens == len(LATE_PROMPT)
