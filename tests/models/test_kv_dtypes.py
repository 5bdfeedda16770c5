"""The KV cache's element types (--kv-cache-dtype float32 | float16 | bfloat16 | q8_0) in the kernels and
the attention backends: the native decode-attention kernel reads each type in place on every ISA variant
this CPU runs, the native cache write and the torch one store the same bytes, and the torch paths widen
what they gather."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import EVERY_VARIANT, kernels_for, needs_native_kernels
from paged_cache import reference_attention, step_metadata
from test_cpu_kernels import assert_batch_invariant, paged_case, reference

from models.kernels import cpu as cpu_kernels
from models.kernels.isa import supported_variants
from models.layers.attention_backends import BatchedDecodeBackend, SdpaBackend
from models.layers.kv_format import (
    Q8_0_BYTES,
    decode,
    dequantize_q8_0,
    encode,
    format_of,
    kv_format,
    quantize_q8_0,
)

KV_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
# Largest error against attention over the float32 values, per type, for unit-variance q and V and K of
# standard deviation 2 (scores of a few units): half keeps 11 bits, bfloat16 8, q8_0 ~7 per block.
TOLERANCE = {"float32": 2e-6, "float16": 5e-3, "bfloat16": 4e-2, "q8_0": 4e-2}


def stored(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x [..., D] as a cache of `dtype` stores it."""
    return encode(x, torch.empty(0, dtype=kv_format(dtype).storage))


def widened(cache: torch.Tensor, d: int) -> torch.Tensor:
    return decode(cache, d, torch.float32)


def test_q8_0_block_layout() -> None:
    # llama.cpp's block_q8_0: a half scale d = max|x| / 127, then 32 int8 codes round(x / d).
    x = torch.arange(-16, 16, dtype=torch.float32) / 4  # max |x| = 4
    raw = quantize_q8_0(x)
    assert raw.dtype == torch.uint8 and raw.shape == (Q8_0_BYTES,)
    assert raw[:2].view(torch.float16).item() == pytest.approx(4 / 127, rel=1e-3)
    codes = raw[2:].view(torch.int8)
    assert codes[0].item() == -127 and codes[16].item() == 0
    assert torch.equal(codes, torch.round(x * (127 / 4)).to(torch.int8))
    torch.testing.assert_close(dequantize_q8_0(raw, 32), x, atol=4 / 127 / 2 + 1e-3, rtol=0)
    zeros = quantize_q8_0(torch.zeros(64))  # a block of zeros: scale 0, codes 0, no NaN
    assert torch.equal(dequantize_q8_0(zeros, 64), torch.zeros(64))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_formats_size_their_rows(dtype: str) -> None:
    f = kv_format(dtype)
    assert (
        f.row_width(64) * torch.empty((), dtype=f.storage).element_size()
        == {
            "float32": 256,
            "float16": 128,
            "bfloat16": 128,
            "q8_0": 68,
        }[dtype]
    )
    assert format_of(torch.empty(0, dtype=f.storage)) == f


def test_bad_kv_dtypes_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'.*q8_0"):
        kv_format("fp8")
    with pytest.raises(ValueError, match="head_dim that is a multiple of 32; this model.s is 48"):
        kv_format("q8_0").check_head_dim(48)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "hq", "hkv", "d", "block_size", "window"),
    [
        ([1, 7, 8, 9, 40], 4, 2, 32, 16, None),  # tile edges of 8 tokens, GQA 2
        ([5, 100, 33, 64, 129], 9, 3, 64, 16, None),  # SmolLM2's heads, span edges
        ([300, 1, 129], 8, 8, 128, 32, None),  # head_dim 128, long history
        ([17, 3], 6, 1, 96, 1, None),  # MQA, block size 1, head_dim neither 64 nor 128
        ([1, 64, 65, 200, 300], 6, 2, 32, 16, 70),  # a sliding window across spans
    ],
)
def test_kernel_reads_each_dtype_in_place(
    variant: str,
    dtype: str,
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    window: int | None,
) -> None:
    q, k32, v32, tables, lens = paged_case(seq_lens, hq, hkv, d, block_size, seed=len(seq_lens) + d)
    k, v = stored(k32, dtype), stored(v32, dtype)
    kern = kernels_for(variant)
    got = kern.paged_decode_attention(q, k, v, tables, lens, d**-0.5, window)
    # Exactly the kernel over the same values held as float32: the widening is exact, nothing else moves.
    same_values = kern.paged_decode_attention(q, widened(k, d), widened(v, d), tables, lens, d**-0.5, window)
    assert torch.equal(got, same_values)
    # And close to attention over the original float32 values, within what the type keeps.
    if window is None:
        expect = reference(q, k32, v32, tables, lens, d**-0.5)
    else:
        md = step_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
        expect = reference_attention(q, k32, v32, md, d**-0.5, window)
    torch.testing.assert_close(got, expect, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_kernel_on_q8_0_is_batch_invariant(variant: str) -> None:
    q, k32, v32, tables, lens = paged_case([200, 3, 64, 130, 1], 9, 3, 64, 16, seed=5)
    assert_batch_invariant(kernels_for(variant), q, stored(k32, "q8_0"), stored(v32, "q8_0"), tables, lens)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("tokens", [1, 40])  # 40: the rows go parallel
def test_native_and_torch_cache_writes_store_the_same_bytes(variant: str, dtype: str, tokens: int) -> None:
    from models.layers.rotary import RopeParams, RotaryEmbedding

    hq, hkv, d, block_size, num_blocks = 4, 2, 64, 4, 16
    rotary = RotaryEmbedding(d, 256, RopeParams(theta=10000.0))
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 3
    qkv[0, hq * d : (hq + 1) * d] = 0  # a head of zeros: q8_0's scale 0
    positions = torch.randint(0, 256, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    storage = kv_format(dtype).storage
    row = kv_format(dtype).row_width(d)
    k_cache = torch.zeros(num_blocks, block_size, hkv, row, dtype=storage)
    v_cache = torch.zeros_like(k_cache)
    kernels_for(variant).rope_and_cache(qkv, positions, rotary.cos_sin_cache, slots, k_cache, v_cache, hq)
    # qkv now holds the rotated k: the torch write of the same rows must give the same bytes.
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    from models.layers.kv_format import write_kv

    write_kv(k_ref, slots, qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d))
    write_kv(v_ref, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_backends_read_every_dtype(dtype: str, native: bool, window: int | None) -> None:
    """cpu-decode with the kernel and with its torch fallback, and sdpa, over a 16-bit or q8_0 cache:
    each equals attention over the cache's values widened to float32."""
    seq_lens, d, bs = [4, 19, 1], 32, 8
    q, k32, v32, tables, _ = paged_case(seq_lens, 4, 2, d, bs)
    k, v = stored(k32, dtype), stored(v32, dtype)
    md = step_metadata([1] * len(seq_lens), seq_lens, tables, bs)
    expect = reference_attention(q, widened(k, d), widened(v, d), md, d**-0.5, window)
    backend = BatchedDecodeBackend()
    backend._native = native and cpu_kernels.available()
    got = backend.forward(q, k, v, md, backend.plan(md), d**-0.5, window)
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=1e-5)
    sdpa = SdpaBackend()
    got = sdpa.forward(q, k, v, md, sdpa.plan(md), d**-0.5, window)
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=1e-5)


@needs_native_kernels
def test_wrappers_refuse_caches_the_kernel_would_misread() -> None:
    q, k32, v32, tables, lens = paged_case([5, 9], 4, 2, 48, 4)
    with pytest.raises(ValueError, match="q8_0, head_dim a multiple of 32"):
        # 48 values a row are not whole q8_0 blocks: no layout the kernel knows.
        cpu_kernels.paged_decode_attention(q, k32.to(torch.uint8), v32.to(torch.uint8), tables, lens, 0.25)
    with pytest.raises(ValueError, match="v_cache: torch.bfloat16, but k_cache is torch.float16"):
        cpu_kernels.paged_decode_attention(q, k32.half(), v32.bfloat16(), tables, lens, 0.25)
    with pytest.raises(ValueError, match="expected shape"):
        q64, k64, v64, t64, l64 = paged_case([5, 9], 4, 2, 64, 4)
        cpu_kernels.paged_decode_attention(
            q64, stored(k64, "q8_0")[..., :-2].contiguous(), stored(v64, "q8_0"), t64, l64, 0.25
        )
    assert cpu_kernels.supports_decode_attention(64, 9, 3, torch.uint8)
    assert not cpu_kernels.supports_decode_attention(48, 4, 2, torch.uint8)
    assert not cpu_kernels.supports_decode_attention(64, 4, 2, torch.int8)


def verification_case(d: int = 64):
    """Rows as a speculative verification lays them out (engine/speculative.py): k + 1 consecutive
    positions of one request over its block table, among plain decode rows. Runs that cross a span edge
    (64 tokens), one of 12 rows (past a task's 10 with 3 heads per KV head: cut in two), a lone row, and
    two requests whose tables differ."""
    q, k, v, tables, _ = paged_case([70, 10, 140, 90], 9, 3, d, 16, seed=11)
    rows = (
        [(0, n) for n in range(61, 67)] + [(1, 10)] + [(2, n) for n in range(120, 132)] + [(3, 90), (3, 91)]
    )
    table = tables[[i for i, _ in rows]]
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), 9, d, generator=torch.Generator().manual_seed(3))
    return q, k, v, table, lens


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_verification_rows_read_their_history_once_and_match_alone(variant: str, dtype: str) -> None:
    """A run of rows over one history is one task per span for all its rows: each row's output equals,
    bit for bit, the same row computed alone (a plain decode step there), and SDPA over the values the
    cache holds."""
    q, k32, v32, tables, lens = verification_case()
    k, v = stored(k32, dtype), stored(v32, dtype)
    kern = kernels_for(variant)
    assert_batch_invariant(kern, q, k, v, tables, lens)
    got = kern.paged_decode_attention(q, k, v, tables, lens, 0.125)
    expect = reference(q, widened(k, 64), widened(v, 64), tables, lens, 0.125)
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "window"),
    [
        (32, 8, 64, None),  # Llama-3.2-1B's heads: groups of 4
        (9, 3, 64, 70),  # SmolLM2's, under a sliding window across spans
        (8, 4, 128, None),  # groups of 2, head_dim 128
        (4, 1, 96, None),  # MQA's one KV head, head_dim neither 64 nor 128
        (6, 6, 32, None),  # no GQA
    ],
)
def test_tasks_over_every_kv_head_match_tasks_per_head(
    variant: str, dtype: str, hq: int, hkv: int, d: int, window: int | None
) -> None:
    """With enough spans in a step (a batch, or long histories) one task takes a span for every KV head,
    reading its rows in address order; alone, a short history goes one task per KV head. Both give every
    sequence the same bits, and the same as a float32 cache of the same values (one task per head)."""
    seq_lens = [1, 63, 64, 65, 129, 200, 300, 17, 520]
    q, k32, v32, tables, lens = paged_case(seq_lens, hq, hkv, d, 16, seed=hq + d)
    k, v = stored(k32, dtype), stored(v32, dtype)
    kern = kernels_for(variant)
    got = kern.paged_decode_attention(q, k, v, tables, lens, 0.125, window)
    for i in range(len(seq_lens)):
        alone = kern.paged_decode_attention(
            q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], 0.125, window
        )
        assert torch.equal(alone[0], got[i]), f"sequence {i} changed with its batch"
    same_values = kern.paged_decode_attention(q, widened(k, d), widened(v, d), tables, lens, 0.125, window)
    assert torch.equal(got, same_values)


# (dtype, hq, hkv, d): every 16-bit and q8_0 cache at head sizes whose rows split into 16-value vectors, and
# a 16-bit one of 40 (five 8-value chunks: the weighted V rows on 256-bit vectors; q8_0 needs d % 32 == 0).
SAME_BITS_CASES = [
    (dtype, *heads)
    for dtype in ("float16", "bfloat16", "q8_0")
    for heads in ((24, 8, 128), (9, 3, 64), (4, 1, 96), (8, 4, 32))
] + [("float16", 6, 2, 40), ("bfloat16", 6, 2, 40)]


@pytest.mark.parametrize(("dtype", "hq", "hkv", "d"), SAME_BITS_CASES)
def test_every_variant_gives_the_same_bits(dtype: str, hq: int, hkv: int, d: int) -> None:
    """The AVX-512 builds hold two 8-lane chains a 512-bit register (two tokens' K values, 16 values of a
    V row) where the AVX2 build holds one: the same chains, so a batch's outputs are the same bits on
    every variant this CPU runs, both through tasks over every KV head (many spans) and alone."""
    runnable = [v.name for v in supported_variants()]
    if len(runnable) < 2:
        pytest.skip("one kernel variant runs on this CPU")
    seq_lens = [1, 63, 64, 65, 129, 200, 300, 17, 520]
    q, k32, v32, tables, lens = paged_case(seq_lens, hq, hkv, d, 16, seed=hq * d)
    k, v = stored(k32, dtype), stored(v32, dtype)
    outputs = {}
    for name in runnable:
        kern = kernels_for(name)
        batch = kern.paged_decode_attention(q, k, v, tables, lens, 0.125)
        alone = kern.paged_decode_attention(q[-1:], k, v, tables[-1:], lens[-1:], 0.125)
        outputs[name] = (batch, alone)
    first, (batch, alone) = next(iter(outputs.items()))
    for name, (b, a) in outputs.items():
        assert torch.equal(b, batch), f"{name} differs from {first} in a batch"
        assert torch.equal(a, alone), f"{name} differs from {first} alone"
