"""The native paged decode-attention, RMSNorm, SiLU-and-mul and rotary kernels against torch, on every
ISA variant this CPU runs, and the cpu-decode backend's fallback when the kernel cannot run. (The
quantized linear has its own file: test_quant_linear.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_marks import EVERY_VARIANT, kernels_for
from paged_cache import reference_attention, step_metadata

from models.kernels import cpu as cpu_kernels
from models.layers.attention_backends import BatchedDecodeBackend


def paged_case(seq_lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int = 0):
    """Random caches and block tables (blocks shuffled, so no sequence is contiguous)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g) * 2
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32)  # padded with block 0
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor(order[start : start + nb], dtype=torch.int32)
        start += nb
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    hkv, d = k_cache.shape[-2:]
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        nb = -(-n // k_cache.shape[1])
        k = k_cache[tables[i, :nb].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)
        v = v_cache[tables[i, :nb].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize(
    ("seq_lens", "hq", "hkv", "d", "block_size"),
    [
        ([1], 1, 1, 8, 16),
        ([1, 7, 8, 9, 40], 4, 2, 16, 16),  # tile edges of 8 tokens, GQA 2
        ([5, 100, 33, 64], 9, 3, 64, 16),  # SmolLM2's heads
        ([300, 1, 129], 8, 8, 128, 32),  # no GQA, head_dim 128, long history
        ([17, 3], 6, 1, 24, 1),  # MQA, block size 1, head_dim neither 64 nor 128
        ([70, 5, 200], 12, 1, 32, 16),  # a GQA group of 12: computed as two tasks of 6 heads
        ([64, 65, 128, 129], 4, 4, 8, 16),  # histories at span edges (64 tokens a span)
    ],
)
def test_kernel_matches_sdpa(
    variant: str, seq_lens: list[int], hq: int, hkv: int, d: int, block_size: int
) -> None:
    case = paged_case(seq_lens, hq, hkv, d, block_size, seed=len(seq_lens) + d)
    scale = d**-0.5
    got = kernels_for(variant).paged_decode_attention(*case, scale)
    torch.testing.assert_close(got, reference(*case, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_kernel_is_stable_for_large_scores(variant: str) -> None:
    # Scores in the hundreds: the online softmax must rescale, not overflow.
    q, k, v, tables, lens = paged_case([50, 9], 2, 1, 16, 4)
    got = kernels_for(variant).paged_decode_attention(q * 40, k, v, tables, lens, 1.0)
    expect = reference(q * 40, k, v, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def assert_batch_invariant(kern, q, k, v, tables, lens) -> None:
    """Every sequence's decode attention, bit for bit, the same alone as in the batch."""
    batched = kern.paged_decode_attention(q, k, v, tables, lens, 0.125)
    for i in range(len(lens)):
        alone = kern.paged_decode_attention(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], batched[i]), f"sequence {i} changed with its batch"


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_kernel_is_batch_invariant(variant: str) -> None:
    # A sequence's output, bit for bit, is the same alone and among others of every length: the
    # split of a history into spans depends on its own length only.
    q, k, v, tables, lens = paged_case([200, 3, 64, 130, 1], 9, 3, 64, 16, seed=5)
    assert_batch_invariant(kernels_for(variant), q, k, v, tables, lens)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("window", [1, 5, 63, 64, 65, 130, 500])
def test_kernel_with_a_sliding_window(variant: str, window: int) -> None:
    # Histories shorter than, at and past the window, across span edges (64 tokens a span): each query
    # sees its last `window` keys only. The reference drops the older keys before attending.
    seq_lens = [1, 7, 64, 65, 129, 200, 300]
    q, k, v, tables, lens = paged_case(seq_lens, 6, 2, 32, 16, seed=window)
    got = kernels_for(variant).paged_decode_attention(q, k, v, tables, lens, 0.2, window)
    expect = []
    for i, n in enumerate(seq_lens):
        nb = -(-n // 16)
        keys = k[tables[i, :nb].long()].reshape(-1, 2, 32)[max(0, n - window) : n].transpose(0, 1)
        vals = v[tables[i, :nb].long()].reshape(-1, 2, 32)[max(0, n - window) : n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, vals, scale=0.2, enable_gqa=True)
        expect.append(o.squeeze(1))
    torch.testing.assert_close(got, torch.stack(expect), atol=2e-6, rtol=1e-5)
    if window >= max(seq_lens):  # a window no history outgrows changes nothing, bit for bit
        assert torch.equal(got, kernels_for(variant).paged_decode_attention(q, k, v, tables, lens, 0.2))


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_kernel_with_a_window_is_batch_invariant(variant: str) -> None:
    q, k, v, tables, lens = paged_case([200, 3, 64, 130, 1, 97], 9, 3, 64, 16, seed=6)
    kern = kernels_for(variant)
    batched = kern.paged_decode_attention(q, k, v, tables, lens, 0.125, 70)
    for i in range(len(lens)):
        alone = kern.paged_decode_attention(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], 0.125, 70)
        assert torch.equal(alone[0], batched[i]), f"sequence {i} changed with its batch"


def test_unsupported_head_dims_are_declined() -> None:
    assert cpu_kernels.supports_decode_attention(64, 9, 3)
    assert not cpu_kernels.supports_decode_attention(12, 4, 2)  # not a multiple of 8
    assert not cpu_kernels.supports_decode_attention(512, 4, 2)  # above the kernel's register budget
    assert not cpu_kernels.supports_decode_attention(64, 9, 2)  # heads not a multiple of KV heads


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("d", [16, 12])
def test_backend_paths_agree(native: bool, d: int, window: int | None) -> None:
    """cpu-decode with and without the kernel (and with a head_dim the kernel declines) gives SDPA."""
    seq_lens = [4, 19, 1]
    q, k_cache, v_cache, tables, _ = paged_case(seq_lens, 4, 2, d, 8)
    md = step_metadata([1, 1, 1], seq_lens, tables, 8)
    backend = BatchedDecodeBackend()
    backend._native = native and cpu_kernels.available()
    out = backend.forward(q, k_cache, v_cache, md, backend.plan(md), d**-0.5, window)
    expect = reference_attention(q, k_cache, v_cache, md, d**-0.5, window)
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: past the rows at which the kernel goes parallel
def test_rms_norm_and_fused_residual(variant: str, rows: int) -> None:
    kern = kernels_for(variant)
    g = torch.Generator().manual_seed(rows)
    x, res, w = (
        torch.randn(rows, 96, generator=g),
        torch.randn(rows, 96, generator=g),
        torch.rand(96, generator=g),
    )
    expect = F.rms_norm(x, (96,), w, 1e-5)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-5), expect, atol=1e-6, rtol=1e-5)
    stream = res.clone()
    normed = kern.rms_norm(x, w, 1e-5, residual=stream)
    torch.testing.assert_close(stream, x + res, atol=0, rtol=0)  # the updated residual stream
    torch.testing.assert_close(normed, F.rms_norm(x + res, (96,), w, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_and_mul(variant: str, rows: int) -> None:
    x = torch.randn(rows, 2 * 40, generator=torch.Generator().manual_seed(rows)) * 6
    x[0, 0], x[0, 1] = -120.0, 120.0  # far outside exp's clamp on both sides
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels_for(variant).silu_and_mul(x), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def test_rms_norm_module_paths_agree() -> None:
    """RMSNorm's native and torch paths (a non-contiguous input takes the torch one) agree, fused or not."""
    from models.layers.norm import RMSNorm

    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.rand(64)
    x = torch.randn(6, 128)[:, ::2]  # non-contiguous: torch path
    res = torch.randn(6, 64)
    slow = norm(x)
    fast = norm(x.contiguous())
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    slow_n, slow_r = norm(x, residual=res.clone())
    fast_n, fast_r = norm(x.contiguous(), residual=res.clone())
    torch.testing.assert_close(fast_r, slow_r, atol=0, rtol=0)
    torch.testing.assert_close(fast_n, slow_n, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("tokens", [1, 4, 40])
@pytest.mark.parametrize("partial", [1.0, 0.5])  # 0.5: the first 16 of 32 dims turn (Phi-4-mini's kind)
def test_rope_and_cache_matches_rotary_and_index_copy(variant: str, tokens: int, partial: float) -> None:
    from models.layers.rotary import RopeParams, RotaryEmbedding

    hq, hkv, d, block_size, num_blocks = 6, 2, 32, 4, 16
    rotary = RotaryEmbedding(d, 256, RopeParams(theta=10000.0, partial_rotary_factor=partial))
    assert rotary.cos_sin_cache.shape == (256, int(d * partial))
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 256, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    k_ref = torch.zeros(num_blocks, block_size, hkv, d)
    v_ref = torch.zeros_like(k_ref)
    qk = rotary(positions, qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d))
    k_ref.view(-1, hkv, d).index_copy_(0, slots, qk[:, hq:])
    v_ref.view(-1, hkv, d).index_copy_(0, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    k_cache, v_cache = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
    kernels_for(variant).rope_and_cache(qkv, positions, rotary.cos_sin_cache, slots, k_cache, v_cache, hq)
    torch.testing.assert_close(qkv[:, : hq * d].view(tokens, hq, d), qk[:, :hq], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_qk_norm_matches_per_head_rms_norm(variant: str, tokens: int) -> None:
    hq, hkv, d = 4, 2, 32
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 3
    qw, kw = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    q, k, v = (t.clone() for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    kernels_for(variant).qk_norm(qkv, qw, kw, 1e-6, hq, hkv)
    got_q, got_k, got_v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q = F.rms_norm(q.view(tokens, hq, d), (d,), qw, 1e-6).view(tokens, -1)
    ref_k = F.rms_norm(k.view(tokens, hkv, d), (d,), kw, 1e-6).view(tokens, -1)
    torch.testing.assert_close(got_q, ref_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=1e-5)
    assert torch.equal(got_v, v)
    # Each head is normalised exactly as the row-wise RMSNorm kernel normalises a row.
    rows = kernels_for(variant).rms_norm(q.view(-1, d).contiguous(), qw, 1e-6)
    assert torch.equal(got_q, rows.view(tokens, -1))


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_wrappers_refuse_what_the_c_code_would_misread(variant: str) -> None:
    kern = kernels_for(variant)
    q, k, v, tables, lens = paged_case([5, 9], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="v_cache"):
        kern.paged_decode_attention(q, k, v[:, :2], tables, lens, 0.25)
    with pytest.raises(ValueError, match="do not match"):
        kern.paged_decode_attention(q, k, v, tables[:1], lens, 0.25)
    with pytest.raises(ValueError, match="residual"):
        kern.rms_norm(torch.randn(3, 16), torch.ones(16), 1e-6, residual=torch.randn(2, 16))
    with pytest.raises(ValueError, match="twice"):
        kern.silu_and_mul(torch.randn(3, 20))
