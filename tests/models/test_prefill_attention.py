"""The native paged prefill-attention kernel (models/kernels/paged_prefill_attention.c) against attention
written from its definition, on every ISA variant this CPU runs: prompt chunks with and without a
cached prefix, sliding windows, GQA groups, head sizes and every KV cache type; a row's result the
same bits however its prompt was chunked and whatever shares the call; and the cpu-decode backend
that sends a step's prompt chunks to it."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from kernel_marks import EVERY_VARIANT, kernels_for, needs_native_kernels
from paged_cache import reference_attention, step_metadata
from test_cpu_kernels import paged_case

from models.kernels import cpu as cpu_kernels
from models.layers.attention_backends import BatchedDecodeBackend
from models.layers.kv_format import decode, encode, kv_format


def chunk_case(
    query_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int = 0
):
    """paged_case's random caches over shuffled blocks and block tables, with queries for every new
    token: [sum(query_lens), hq, d]."""
    _, k_cache, v_cache, tables, _ = paged_case(seq_lens, hq, hkv, d, block_size, seed)
    q = torch.randn(sum(query_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1))
    return q, k_cache, v_cache, tables


def run_kernel(kern, q, k_cache, v_cache, tables, query_lens, seq_lens, scale, window=None):
    return kern.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(query_lens, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        window,
    )


class Case(NamedTuple):
    query_lens: list[int]  # new tokens a sequence
    seq_lens: list[int]  # its history after them
    hq: int
    hkv: int
    d: int
    block_size: int


CASES = [
    Case([1], [1], 1, 1, 16, 16),
    Case([7, 64, 65], [7, 64, 65], 4, 2, 16, 16),  # whole prompts at key-tile edges (64 keys a tile)
    Case([100, 30, 1, 129], [100, 94, 200, 300], 9, 3, 64, 16),  # SmolLM2's heads; chunks after a prefix
    Case([300], [300], 32, 8, 64, 16),  # Llama 3.2 1B's heads, several row tiles
    Case([40, 77], [170, 77], 8, 8, 128, 32),  # no GQA, head_dim 128
    Case([33], [90], 6, 1, 80, 1),  # MQA, block size 1, head_dim 80
    Case([20, 5], [20, 300], 8, 1, 256, 16),  # head_dim 256 (Gemma 3), a group of 8
]


@needs_native_kernels
@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c.query_lens}-{c.seq_lens}-{c.hq}/{c.hkv}x{c.d}" for c in CASES]
)
@pytest.mark.parametrize("window", [None, 1, 5, 64, 70])
def test_kernel_matches_attention_by_definition(variant: str, case: Case, window: int | None) -> None:
    q, k_cache, v_cache, tables = chunk_case(*case, seed=case.d + case.hq)
    md = step_metadata(case.query_lens, case.seq_lens, tables, case.block_size)
    scale = case.d**-0.5
    kern = kernels_for(variant)
    got = run_kernel(kern, q, k_cache, v_cache, tables, case.query_lens, case.seq_lens, scale, window)
    expect = reference_attention(q, k_cache, v_cache, md, scale, window)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


@needs_native_kernels
@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16", "q8_0"])
def test_kernel_reads_every_cache_type_in_place(variant: str, cache_dtype: str) -> None:
    """A 16-bit or q8_0 cache gives what the same values stored as float32 give, bit for bit."""
    query_lens, seq_lens, d = [50, 70], [120, 70], 64
    q, k32, v32, tables = chunk_case(query_lens, seq_lens, 8, 2, d, 16, seed=3)
    fmt = kv_format(cache_dtype)
    k, v = (encode(c, torch.empty(0, dtype=fmt.storage)) for c in (k32, v32))
    # The float32 cache the narrow one holds: its values widened.
    k_wide, v_wide = (decode(c, d, torch.float32) for c in (k, v))
    kern = kernels_for(variant)
    got = run_kernel(kern, q, k, v, tables, query_lens, seq_lens, 0.125, 9)
    expect = run_kernel(kern, q, k_wide, v_wide, tables, query_lens, seq_lens, 0.125, 9)
    assert torch.equal(got, expect)


@needs_native_kernels
@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("window", [None, 37])
def test_a_row_is_the_same_bits_however_its_prompt_is_chunked(variant: str, window: int | None) -> None:
    """One 230-token prompt in one call, in three chunks (each after the cached tokens before it), and
    batched with other requests: every row the same bits (prefix caching and chunked prefill leave
    greedy output unchanged)."""
    kern = kernels_for(variant)
    n = 230
    q, k_cache, v_cache, tables = chunk_case([n], [n], 12, 4, 64, 16, seed=5)
    whole = run_kernel(kern, q, k_cache, v_cache, tables, [n], [n], 0.125, window)
    pieces, start = [], 0
    for end in (61, 192, n):
        part = q[start:end]
        pieces.append(run_kernel(kern, part, k_cache, v_cache, tables, [end - start], [end], 0.125, window))
        start = end
    assert torch.equal(torch.cat(pieces), whole)
    # Batched: another request's chunk before it, the same prompt's tail after a prefix after it.
    other = torch.randn(17, 12, 64)
    both_q = torch.cat([other, q, q[100:]])
    both_tables = torch.cat([tables, tables, tables])
    both = run_kernel(
        kern, both_q, k_cache, v_cache, both_tables, [17, n, n - 100], [17, n, n], 0.125, window
    )
    assert torch.equal(both[17 : 17 + n], whole)
    assert torch.equal(both[17 + n :], whole[100:])


@needs_native_kernels
def test_kernel_is_stable_for_large_scores() -> None:
    # Scores in the hundreds: the online softmax must rescale across key tiles, not overflow.
    q, k_cache, v_cache, tables = chunk_case([150], [150], 2, 1, 16, 4)
    md = step_metadata([150], [150], tables, 4)
    got = run_kernel(cpu_kernels.kernels(), q * 40, k_cache, v_cache, tables, [150], [150], 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got, reference_attention(q * 40, k_cache, v_cache, md, 1.0), atol=1e-5, rtol=1e-5
    )


def test_supported_shapes() -> None:
    assert cpu_kernels.supports_prefill_attention(64, 32, 8)
    assert cpu_kernels.supports_prefill_attention(256, 8, 1)
    assert not cpu_kernels.supports_prefill_attention(24, 4, 2)  # not a multiple of 16
    assert not cpu_kernels.supports_prefill_attention(512, 4, 2)
    assert not cpu_kernels.supports_prefill_attention(64, 9, 2)  # heads not a multiple of KV heads


@needs_native_kernels
def test_wrapper_refuses_lengths_the_kernel_would_misread() -> None:
    kern = cpu_kernels.kernels()
    q, k_cache, v_cache, tables = chunk_case([10], [10], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="do not match"):
        run_kernel(kern, q, k_cache, v_cache, tables, [9], [10], 0.25)  # rows of q != sum(query_lens)
    with pytest.raises(ValueError, match="query_len in 1..seq_len"):
        run_kernel(kern, q, k_cache, v_cache, tables, [10], [9], 0.25)  # more new tokens than history


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("d", [16, 24])  # 24: the prefill kernel declines it (sdpa), the decode one not
def test_backend_sends_decodes_and_prompt_chunks_to_their_paths(
    native: bool, d: int, window: int | None
) -> None:
    """A step of two decodes, a whole prompt and a chunk after a cached prefix through cpu-decode, with
    and without the native kernels: attention by definition."""
    query_lens, seq_lens = [1, 1, 40, 13], [9, 30, 40, 77]
    q, k_cache, v_cache, tables = chunk_case(query_lens, seq_lens, 4, 2, d, 8, seed=d)
    md = step_metadata(query_lens, seq_lens, tables, 8)
    backend = BatchedDecodeBackend()
    backend._native = native and cpu_kernels.available()
    out = backend.forward(q, k_cache, v_cache, md, backend.plan(md), d**-0.5, window)
    expect = reference_attention(q, k_cache, v_cache, md, d**-0.5, window)
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=1e-5)
