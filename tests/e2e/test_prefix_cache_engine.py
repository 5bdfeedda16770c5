"""Prefix caching through the real engine (LocalExecutor, tiny random Llama, float32): a prompt that
starts from cached blocks gets the same greedy tokens as a cold run, whatever shares its batch, and n
choices of one prompt compute it once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from builders import cpu_engine_config

from engine.contract import SamplingParams
from engine.executor import LocalExecutor
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from scheduler.outputs import FinishReason, RequestDelta

GUARD_S = 120
BLOCK_SIZE = 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return [20 + (seed * 977 + i * 131) % 40000 for i in range(n)]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(tiny_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))


class Run:
    """One IterationLoop (a fresh, empty prefix cache) over the shared runner."""

    def __init__(self, runner: LocalExecutor, caching: bool, **cfg) -> None:
        self.engine = IterationLoop(runner, SchedulerConfig(enable_prefix_caching=caching, **cfg))
        self.cached: dict[str, int] = {}
        self._next = 0

    async def __aenter__(self) -> Run:
        await self.engine.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.shutdown()

    async def generate(self, prompt_ids: list[int], max_tokens: int = 12) -> list[int]:
        rid = f"r{self._next}"
        self._next += 1
        out: list[int] = []

        async def consume() -> None:
            async for d in self.engine.generate(prompt_ids, greedy(max_tokens), rid):
                assert d.finish_reason in (None, FinishReason.LENGTH), d.error
                out.extend(d.token_ids)
                self.cached[rid] = d.num_cached_tokens

        await asyncio.wait_for(consume(), GUARD_S)
        return out

    async def together(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        return list(await asyncio.gather(*(self.generate(p, max_tokens) for p in prompts)))


async def cold(runner: LocalExecutor, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """Each prompt alone on an engine without caching: the reference."""
    out = []
    for p in prompts:
        async with Run(runner, caching=False) as run:
            out.append(await run.generate(p, max_tokens))
    return out


async def test_cached_prefixes_give_the_tokens_of_a_cold_run(runner: LocalExecutor):
    system = prompt(37, seed=1)
    a = [*system, *prompt(9, seed=2)]
    b = [*system, *prompt(14, seed=3)]
    async with Run(runner, caching=True) as run:
        first = await run.generate(a)
        again = await run.generate(a)  # everything but the last partial block from the cache
        other = await run.generate(b)  # the shared system prompt from the cache
        # The next turn of a chat: the history, the reply, and a new message.
        turn2 = [*a, *first, *prompt(6, seed=4)]
        second_turn = await run.generate(turn2)
        stats = run.engine.stats().prefix_cache
    # turn 2: the 57 computed tokens of a + reply fill 14 blocks (the reply's last token was never run)
    assert run.cached == {"r0": 0, "r1": 44, "r2": 36, "r3": 56}
    assert [first, again, other, second_turn] == await cold(runner, [a, a, b, turn2])
    assert stats.hits == 44 + 36 + 56 and stats.cached_blocks > 0


async def test_cached_prefixes_do_not_depend_on_what_shares_the_batch(runner: LocalExecutor):
    system = prompt(41, seed=5)
    prompts = [[*system, *prompt(3 + 4 * i, seed=10 + i)] for i in range(4)]
    strangers = [prompt(17 + 5 * i, seed=30 + i) for i in range(3)]
    async with Run(runner, caching=True, max_num_batched_tokens=64) as run:
        await run.generate(system[:40], max_tokens=1)  # warm the cache with the system prompt
        got = await run.together([*prompts, *strangers])  # chunked, mixed with decodes and strangers
    assert got == await cold(runner, [*prompts, *strangers])
    assert all(run.cached[f"r{i}"] == 40 for i in range(1, 5))


async def test_n_choices_compute_their_prompt_once(runner: LocalExecutor):
    p = prompt(98, seed=7)  # 24 full blocks + 2 tokens
    async with Run(runner, caching=True) as run:
        outs = await run.together([p] * 8, max_tokens=6)
        computed = run.engine.stats().prefix_cache.computed_prompt_tokens
    assert outs == [outs[0]] * 8 and outs[0] == (await cold(runner, [p], max_tokens=6))[0]
    assert computed == 98 + 7 * 2  # once, then each other choice its last partial block
    assert sorted(run.cached.values()) == [0] + [96] * 7

    async with Run(runner, caching=False) as off:
        await off.together([p] * 8, max_tokens=6)
        assert off.engine.stats().prefix_cache.computed_prompt_tokens == 8 * 98


async def test_reserve_and_request_batching_reuse_the_cache(runner: LocalExecutor):
    system = prompt(30, seed=8)
    prompts = [[*system, *prompt(5 + i, seed=40 + i)] for i in range(3)]
    want = await cold(runner, prompts)
    for cfg in ({"kv_policy": "reserve"}, {"scheduling": "request", "kv_policy": "reserve"}):
        async with Run(runner, caching=True, **cfg) as run:
            await run.generate(system, max_tokens=1)
            assert await run.together(prompts) == want
        assert all(run.cached[f"r{i}"] == 28 for i in range(1, 4)), cfg


async def test_sliding_window_model_from_the_cache_and_after_preemption(tiny_gemma3_dir: Path):
    """Gemma 3's local layers (window 8) beside its global ones: every layer's K/V stays in the blocks,
    so a prefix far longer than the window, taken from the cache, gives a cold run's tokens, and so
    does a request preempted and recomputed on a tight cache."""
    gemma = LocalExecutor(cpu_engine_config(tiny_gemma3_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))
    system = prompt(37, seed=11)
    prompts = [[*system, *prompt(5 + 3 * i, seed=50 + i)] for i in range(3)]
    want = await cold(gemma, prompts, max_tokens=14)
    async with Run(gemma, caching=True, max_num_seqs=8, max_num_batched_tokens=24) as run:
        await run.generate(system, max_tokens=1)
        assert await run.together(prompts, max_tokens=14) == want  # chunked, from the cache
    assert all(run.cached[f"r{i}"] == 36 for i in range(1, 4))

    tight = LocalExecutor(cpu_engine_config(tiny_gemma3_dir, block_size=BLOCK_SIZE, num_kv_blocks=26))
    # Prompts of 20-28 tokens and 30 new ones each, in 26 blocks of 4 tokens: all three are admitted
    # (18 blocks), lazy allocation then preempts, and the victim recomputes (from what its preemption
    # left cached).
    distinct = [prompt(20 + 4 * i, seed=60 + i) for i in range(3)]
    want = await cold(gemma, distinct, max_tokens=30)
    async with Run(tight, caching=True, max_num_seqs=3) as run:
        assert await run.together(distinct, max_tokens=30) == want
        assert run.engine.stats().num_preemptions > 0


async def test_a_model_windowed_everywhere_gives_blocks_back(
    tiny_mistral_window_dir: Path, tiny_gemma3_dir: Path
) -> None:
    """Mistral with a 6-token window on every layer reads no key behind it, so the scheduler gives
    those blocks back (Executor.kv_window): three requests of 52-54 tokens run at once in 14 blocks of
    4 (56 tokens), each with transformers' greedy tokens. Gemma 3's global layers read every key: it
    keeps every block."""
    import torch

    from models.loader import load_hf_model

    assert (
        LocalExecutor(cpu_engine_config(tiny_gemma3_dir, block_size=BLOCK_SIZE, num_kv_blocks=8)).kv_window
        is None
    )
    runner = LocalExecutor(
        cpu_engine_config(tiny_mistral_window_dir, block_size=BLOCK_SIZE, num_kv_blocks=14)
    )
    assert runner.kv_window == 6
    prompts = [prompt(22 + 2 * i, seed=70 + i) for i in range(3)]
    async with Run(runner, caching=True, max_num_seqs=3, max_num_batched_tokens=12) as run:
        got = await run.together(prompts, max_tokens=30)
        assert run.engine.stats().num_preemptions == 0
    hf = load_hf_model(tiny_mistral_window_dir, torch.float32)
    for p, tokens in zip(prompts, got, strict=True):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert tokens == out[0, len(p) :].tolist()


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
async def test_new_families_from_the_cache_equal_cold_runs(family: str, request: pytest.FixtureRequest):
    """Qwen3 (q/k norms) and Phi-4-mini-like (partial rotary, LongRoPE) models: prompts that start
    from cached blocks, alone and batched together, give a cold run's greedy tokens."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    runner = LocalExecutor(cpu_engine_config(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))
    system = prompt(37, seed=1)
    a, b, c = ([*system, *prompt(n, seed=s)] for n, s in ((9, 2), (14, 3), (5, 4)))
    async with Run(runner, caching=True) as run:
        first = await run.generate(a)
        again = await run.generate(a)
        batched = await run.together([b, c])
    assert run.cached["r1"] == 44 and run.cached["r2"] == run.cached["r3"] == 36
    assert [first, again, *batched] == await cold(runner, [a, a, b, c])


@pytest.mark.parametrize(
    "model", ["tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_olmoe_dir", "tiny_qwen2_moe_dir"]
)
async def test_mixture_of_experts_from_the_cache_batched_with_others(model: str, request) -> None:
    """A mixture of experts' tokens grouped by expert with other requests' (chunked prefills and
    decodes) and started from cached blocks: the tokens of each prompt run cold and alone."""
    moe = LocalExecutor(
        cpu_engine_config(request.getfixturevalue(model), block_size=BLOCK_SIZE, num_kv_blocks=256)
    )
    system = prompt(29, seed=11)
    prompts = [[*system, *prompt(2 + 5 * i, seed=50 + i)] for i in range(3)]
    strangers = [prompt(13 + 7 * i, seed=60 + i) for i in range(2)]
    async with Run(moe, caching=True, max_num_batched_tokens=64) as run:
        await run.generate(system, max_tokens=1)
        got = await run.together([*prompts, *strangers])
    assert got == await cold(moe, [*prompts, *strangers])
    assert all(run.cached[f"r{i}"] == 28 for i in range(1, 4))


async def collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [d async for d in stream]


async def logprobs_of(
    runner: LocalExecutor, prompts: list[list[int]], **cfg
) -> list[tuple[list[tuple[int, float]], int]]:
    """Each prompt's greedy tokens with their logprobs, and its cached tokens, one request after the
    other on one engine."""
    loop = IterationLoop(runner, SchedulerConfig(**cfg))
    await loop.start()
    try:
        out = []
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
            deltas = await asyncio.wait_for(collect(loop.generate(p, params, f"r{i}")), GUARD_S)
            assert deltas[-1].error is None
            tokens = [(t.token_id, t.logprob) for d in deltas for t in d.logprobs or ()]
            out.append((tokens, deltas[-1].num_cached_tokens))
        return out
    finally:
        await loop.shutdown()


@pytest.mark.parametrize("n", [13, 14, 15, 16])  # every remainder of the block size (4)
async def test_a_prompt_gets_the_same_logprobs_bit_for_bit_cold_cached_and_chunked(tiny_gguf_llama_dir, n):
    """With packed weights every step is batch-invariant, so a prompt's logprobs are the same floats
    whether it ran whole, in chunks of a small token budget, or after its own cached blocks: every
    prompt row goes through the prompt attention kernel (a cache hit or a chunk never leaves a
    one-token chunk, which would run through the decode kernel)."""
    packed = LocalExecutor(cpu_engine_config(tiny_gguf_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))
    p = prompt(n, seed=n)
    ((whole, _),) = await logprobs_of(packed, [p], enable_prefix_caching=False)
    (first, _), (again, cached) = await logprobs_of(packed, [p, p], enable_prefix_caching=True)
    ((chunked, _),) = await logprobs_of(
        packed, [p], enable_prefix_caching=False, max_num_batched_tokens=5, max_num_seqs=2
    )
    assert len(whole) == 6 and cached == (n - 2) // BLOCK_SIZE * BLOCK_SIZE
    assert first == whole and again == whole and chunked == whole
