"""A smaller KV cache (--kv-cache-dtype) through the real engine, on a tiny GGUF-structured Llama with
head_dim 32 (whole q8_0 blocks; packed weights, so decode steps take the native fused call and the
native attention kernel reads the cache in place): greedy tokens against a float32 cache, and q8_0
through prefix caching, preemption, chunked prefill and speculative decoding (n-gram and a draft
model, whose own cache is q8_0 too, rolled back with the target's)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from builders import cpu_engine_config
from kernel_marks import native_calls
from test_speculative import PROMPTS, SCENARIOS, greedy, run, same_as_without, tokens

from engine.config import EngineConfig
from engine.executor import LocalExecutor

BLOCK_SIZE = 4
# Prompts of 8 to 63 tokens, 32 new tokens each, for the agreement rate.
LONGER = [[20 + (s * 977 + i * 131) % 40000 for i in range(8 + 5 * s)] for s in range(12)]

_executors: dict[tuple[str, str, int, bool], LocalExecutor] = {}


@pytest.fixture
def executor(tiny_gguf_llama_d32_dir: Path):
    """executor(kv_cache_dtype, weight_packing, num_kv_blocks, drafted): built once per module run."""

    def make(kv: str, packing: str = "float32", blocks: int = 256, drafted: bool = False) -> LocalExecutor:
        key = (kv, packing, blocks, drafted)
        if key not in _executors:
            draft = {"draft_model": str(tiny_gguf_llama_d32_dir)} if drafted else {}
            _executors[key] = LocalExecutor(
                cpu_engine_config(
                    tiny_gguf_llama_d32_dir,
                    block_size=BLOCK_SIZE,
                    num_kv_blocks=blocks,
                    kv_cache_dtype=kv,
                    weight_packing=packing,
                    **draft,
                )
            )
        return _executors[key]

    return make


@pytest.fixture(scope="module", autouse=True)
def _drop_executors():
    yield
    _executors.clear()


def test_decode_steps_read_the_q8_0_cache_in_the_native_call(executor, monkeypatch) -> None:
    q8 = executor("q8_0")
    cache = q8.runner.kv_cache
    assert cache.k_cache.dtype.itemsize == 1 and cache.k_cache.shape[-1] == 34  # one q8_0 block a head
    assert executor("float16").runner.kv_cache.k_cache.shape[-1] == 32
    taken = native_calls(monkeypatch)
    run(q8, [(PROMPTS[0], greedy(4))], "off")
    assert taken == [False, True, True, True]  # the prompt step runs the modules, every decode step is native


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("packing", ["float32", "int8"])
def test_short_prompts_give_the_float32_kv_greedy_tokens(executor, kv: str, packing: str) -> None:
    """Four short prompts, 24 greedy tokens each, batched: identical to a float32 cache."""
    requests = [(p, greedy(24)) for p in PROMPTS]
    want, _ = run(executor("float32", packing), requests, "off")
    got, _ = run(executor(kv, packing), requests, "off")
    assert tokens(got) == tokens(want)


# Measured on this model (float32 activations): the share of the 12 x 32 tokens produced before a
# sequence's first difference from the float32 cache was 0.92 for float16 and bfloat16 (11 of 12
# sequences identical; the 12th's first token is a near tie, top-2 logit gap 0.01) and 0.84 for q8_0
# (8 of 12 identical). The bounds leave room for another CPU's float rounding in torch's ops.
AGREEMENT = {"float16": 0.85, "bfloat16": 0.85, "q8_0": 0.75}


@pytest.mark.parametrize("kv", list(AGREEMENT))
def test_greedy_agreement_with_a_float32_cache(executor, kv: str) -> None:
    requests = [(p, greedy(32)) for p in LONGER]
    want = tokens(run(executor("float32"), requests, "off")[0])
    got = tokens(run(executor(kv), requests, "off")[0])
    agreed = 0
    for a, b in zip(want, got, strict=True):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    rate = agreed / sum(len(a) for a in want)
    assert rate >= AGREEMENT[kv], f"{kv}: {rate:.3f} of the tokens before the first difference"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_q8_0_speculation_is_lossless_in_every_scheduling_situation(executor, scenario: str) -> None:
    """n-gram speculation over a q8_0 cache (rejected proposals' K/V overwritten later), with chunked
    prefill, preemption and recompute, no prefix caching and reserve: the tokens without it."""
    requests = [(p, greedy(24 + 2 * i)) for i, p in enumerate(PROMPTS)]
    sched = same_as_without(executor("q8_0"), requests, "ngram", **SCENARIOS[scenario])
    if scenario == "preemption":
        assert sched.num_preemptions > 0


def test_q8_0_preemption_and_chunks_give_the_roomy_run_tokens(executor) -> None:
    requests = [(p, greedy(24 + 2 * i)) for i, p in enumerate(PROMPTS)]
    roomy, _ = run(executor("q8_0"), requests, "off", enable_prefix_caching=False)
    tight, sched = run(executor("q8_0"), requests, "ngram", num_kv_blocks=24, max_num_batched_tokens=12)
    assert sched.num_preemptions > 0
    assert tokens(tight) == tokens(roomy)


def test_q8_0_prefix_cached_prompts_keep_their_tokens(executor) -> None:
    """A repeat and a follow-up that quotes an earlier answer start from cached q8_0 blocks."""
    q8 = executor("q8_0")
    first, _ = run(q8, [(PROMPTS[1], greedy(30))], "off")
    follow_up = [*PROMPTS[1], *first[0].output_token_ids, 42]
    requests = [(PROMPTS[1], greedy(30)), (PROMPTS[1], greedy(30)), (follow_up, greedy(20))]
    cold, _ = run(q8, requests, "off", enable_prefix_caching=False, max_num_seqs=1)
    sched = same_as_without(q8, requests, "ngram", max_num_seqs=1)
    assert sched.prefix_cache_stats().hits > 0
    cached, _ = run(q8, requests, "off", max_num_seqs=1)
    assert tokens(cached) == tokens(cold)


def test_a_q8_0_draft_that_is_the_target_is_always_right(executor) -> None:
    """The draft's own q8_0 cache follows the target's through rollbacks, catch-ups and preemptions."""
    requests = [(p, greedy(30)) for p in PROMPTS]
    drafted = executor("q8_0", drafted=True)
    assert drafted.proposer is not None
    assert drafted.proposer.runner.kv_cache.k_cache.shape[-1] == 34
    plain, _ = run(executor("q8_0"), requests, "off")
    spec, sched = run(drafted, requests, "draft", num_kv_blocks=24)
    stats = sched.stats().speculation
    assert stats.proposed_tokens > 20 and stats.accepted_tokens == stats.proposed_tokens
    assert sched.num_preemptions > 0
    assert tokens(spec) == tokens(plain)


def test_bad_kv_cache_dtypes_are_refused_clearly(tiny_llama_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \['auto', 'float32'.*'q8_0'\], got 'fp8'"
    ):
        EngineConfig(kv_cache_dtype="fp8")
    p = argparse.ArgumentParser(exit_on_error=False)
    EngineConfig.add_cli_args(p)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int4'"):
        p.parse_args(["--kv-cache-dtype", "int4"])
    assert EngineConfig.from_cli_args(p.parse_args(["--kv-cache-dtype", "q8_0"])).kv_cache_dtype == "q8_0"
    # The tiny Llama's heads are 16 wide: not whole q8_0 blocks. Refused at start-up, with the reason.
    with pytest.raises(
        ValueError, match="q8_0 needs a head_dim that is a multiple of 32; this model's is 16"
    ):
        LocalExecutor(cpu_engine_config(tiny_llama_dir, num_kv_blocks=8, kv_cache_dtype="q8_0"))


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_sliding_windows_over_a_16_bit_cache(tiny_gemma3_dir: Path, kv: str) -> None:
    """Gemma 3's local layers (window 8) beside its global ones, prompts of 12-33 tokens: a 16-bit cache
    gives the float32 cache's greedy tokens (float32 activations), and the same tokens again when
    chunked prefill and preemption recompute part of the history (int8 activations too: their per-row
    rounding can turn a 16-bit difference into another token against float32, not between runs)."""
    prompts = [[20 + (s * 977 + i * 131) % 40000 for i in range(12 + 7 * s)] for s in range(4)]
    requests = [(p, greedy(20)) for p in prompts]

    def gemma(kv_cache_dtype: str, packing: str) -> LocalExecutor:
        return LocalExecutor(
            cpu_engine_config(
                tiny_gemma3_dir,
                block_size=BLOCK_SIZE,
                num_kv_blocks=256,
                kv_cache_dtype=kv_cache_dtype,
                weight_packing=packing,
            )
        )

    want = tokens(run(gemma("float32", "float32"), requests, "off")[0])
    assert tokens(run(gemma(kv, "float32"), requests, "off")[0]) == want
    int8 = gemma(kv, "int8")
    plain = tokens(run(int8, requests, "off")[0])
    tight, sched = run(int8, requests, "off", num_kv_blocks=26, max_num_batched_tokens=12)
    assert sched.num_preemptions > 0
    assert tokens(tight) == plain
