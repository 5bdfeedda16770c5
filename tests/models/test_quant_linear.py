"""The quantized-linear kernel (models/kernels/quant_linear.c) on every ISA variant this CPU runs:
exact weights, both precisions against references, bit-identical results across variants, and batch
invariance (a row's output never depends on the other rows of its batch)."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import EVERY_VARIANT, kernels_for, needs_native_kernels

from models.kernels import cpu as cpu_kernels
from models.kernels.isa import supported_variants
from models.layers.packed_weight import (
    FORMATS,
    BlockComponents,
    PackedSegment,
    PackedWeight,
    pack_components,
    random_components,
)

# Row counts that cross every blocking of the kernel: the int8 micro-kernels (one per row count up to 8;
# AVX2: 4, and 8 for Q6_K and Q3_K; AVX-512 VNNI's for Q6_K and Q3_K up to 12), the float ones (12 or
# 6), AMX's 16-row blocks, and more than one 256-row block. With the row checked beside them, batches of
# 2..13 rows reach every int8 micro-kernel in one piece.
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 33, 100, 300]


def _codes(c: BlockComponents) -> torch.Tensor:
    """The integer each code stands for: offset 4-bit codes, codebook values, or 8-bit codes."""
    f = c.fmt
    if f.codebook is not None:
        return torch.tensor(f.codebook, dtype=torch.float32)[c.codes.long()]
    return c.codes.float() if f.bits == 8 else (c.codes.int() + f.offset).float()


def _group_scales(c: BlockComponents) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(weights per scale group, a [N, K / group], z [N, K / group] or None), in float32 as the
    kernel computes them: a = d * sc, z = -(dmin * m) for the K-quant kinds."""
    f = c.fmt
    if f.kind == "f16":
        return 32, c.scale.float(), c.minimum.float() if f.has_min else None
    gs = f.sub_group
    per = f.super_k // gs
    a = c.scale.float().repeat_interleave(per, 1) * c.sub_scale.float()
    z = -(c.minimum.float().repeat_interleave(per, 1) * c.sub_min.float()) if f.has_min else None
    return gs, a, z


def reference_weight(c: BlockComponents) -> torch.Tensor:
    """w = a * q + z from the components, in torch (independent of the C tile decoder); the raw kind's
    16-bit floats widened."""
    if c.fmt.kind == "raw":
        return c.codes.float()
    gs, a, z = _group_scales(c)
    q = _codes(c)
    a = a.repeat_interleave(gs, 1)
    return a * q if z is None else a * q + z.repeat_interleave(gs, 1)


def quantize_x(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per `group` values exactly as the kernel does (float32 ops, round half to even):
    (codes [M, K / group, group], scales [M, K / group])."""
    m, k = x.shape
    xb = x.view(m, k // group, group)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    return torch.round(xb * inv.unsqueeze(-1)), d


def int8_reference(x: torch.Tensor, c: BlockComponents) -> torch.Tensor:
    """The int8 path's arithmetic in float64: x quantized per 32 exactly as the kernel does, exact
    integer dot products per block, then the scale products. The K-quants: super_reference. The raw
    kind (F16, BF16) has no int8 path: its floats multiply float32 activations whatever is asked."""
    if c.fmt.kind == "raw":
        return x.double() @ reference_weight(c).double().T
    if c.fmt.kind != "f16":
        return super_reference(x, c)
    m, k = x.shape
    xq, dx = quantize_x(x, 32)  # [M, G, 32]
    q = _codes(c)
    n = q.shape[0]
    _, a, z = _group_scales(c)  # per block a [N, G] and z
    isum = torch.einsum("mgk,ngk->mng", xq.double(), q.view(n, k // 32, 32).double())  # exact in float64
    t = (a.unsqueeze(0) * dx.unsqueeze(1)).double()  # the kernel's float32 product a * dx
    y = (isum * t).sum(-1)
    if z is not None:
        sx = (dx * xq.sum(-1)).double()  # [M, G]: the kernel's dx * sum(xq), in float32
        y = y + (z.double().unsqueeze(0) * sx.unsqueeze(1)).sum(-1)
    return y


def super_reference(x: torch.Tensor, c: BlockComponents) -> torch.Tensor:
    """The K-quants' int8 path (int_tile_super) in float64: x quantized per super-block of 256; per
    super-block the exact integer dot products of its sub-groups weighed by their integer sub-scales
    (the minimums likewise, over x's sums per sub-group), each converted to float32 once, times d * dx
    and -(dmin * dx)."""
    f = c.fmt
    m, k = x.shape
    n, gs = c.codes.shape[0], f.sub_group
    per = 256 // gs  # sub-groups a super-block
    xq, dx = quantize_x(x, 256)  # [M, S, 256], [M, S]
    q = _codes(c).double().view(n, k // 256, per, gs)
    xs = xq.double().view(m, k // 256, per, gs)
    isums = torch.einsum("msjk,nsjk->mnsj", xs, q)  # exact: integers
    isum = (isums * c.sub_scale.double().view(n, k // 256, per).unsqueeze(0)).sum(-1)  # [M, N, S]
    y = (isum.float().double() * (c.scale.float().unsqueeze(0) * dx.unsqueeze(1)).double()).sum(-1)
    if f.has_min:
        mins = c.sub_min.double().view(n, k // 256, per).unsqueeze(0)
        corr = (xs.sum(-1).unsqueeze(1) * mins).sum(-1)
        y = y - (corr.float().double() * (c.minimum.float().unsqueeze(0) * dx.unsqueeze(1)).double()).sum(-1)
    return y


def packed(c: BlockComponents) -> PackedWeight:
    return PackedWeight((pack_components(c),))


def shape_for(fmt: str) -> tuple[int, int]:
    # 37 rows: two full 16-row tiles and a 5-row tail; K: several blocks (K-quants: two super-blocks)
    return (37, 512) if FORMATS[fmt].kind not in ("f16", "raw") else (37, 192)


@needs_native_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiles_decode_to_the_formats_values(fmt: str) -> None:
    n, k = shape_for(fmt)
    c = random_components(FORMATS[fmt], n, k, seed=3)
    w = packed(c)
    assert w.shape == (n, k) and w.formats == (fmt,)
    assert cpu_kernels.kernels().tile_bytes(FORMATS[fmt].id, k) == FORMATS[fmt].tile_bytes(k)
    assert torch.equal(w.dequantize(), reference_weight(c))
    rows = torch.tensor([[36, 0], [17, 17]])
    assert torch.equal(w.dequantize(rows), reference_weight(c)[rows])


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_matches_references(variant: str, fmt: str) -> None:
    kern = kernels_for(variant)
    n, k = shape_for(fmt)
    c = random_components(FORMATS[fmt], n, k, seed=5)
    w = packed(c)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    x[3] = 0.0  # a zero row: every block scale 0
    exact = x.double() @ reference_weight(c).double().T
    got = kern.quant_linear(x, w, "float32").double()
    torch.testing.assert_close(got, exact, atol=1e-5 * k**0.5, rtol=1e-5)
    got = kern.quant_linear(x, w, "int8").double()
    torch.testing.assert_close(got, int8_reference(x, c), atol=1e-5 * (k / 16) ** 0.5, rtol=1e-5)
    # ... and int8 activations stay close to the exact product (~0.5% of its scale)
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("precision", ["int8", "float32"])
@pytest.mark.parametrize(
    "fmt", ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "F16", "BF16"]
)
def test_batch_invariance(variant: str, precision: str, fmt: str) -> None:
    """One row alone and the same row at different places inside batches of every size give
    bit-identical outputs."""
    kern = kernels_for(variant)
    n, k = shape_for(fmt)
    w = packed(random_components(FORMATS[fmt], n, k, seed=7))
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, k, generator=g)
    alone = kern.quant_linear(row, w, precision)
    for m in ROW_COUNTS:
        others = torch.randn(m, k, generator=g) * 3
        at = m // 2
        batch = torch.cat([others[:at], row, others[at:]])
        out = kern.quant_linear(batch, w, precision)
        assert torch.equal(out[at : at + 1], alone), f"row count {m + 1}"
        assert torch.equal(out[:at], kern.quant_linear(others[:at], w, precision))


@needs_native_kernels
@pytest.mark.parametrize("precision", ["int8", "float32"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_variants_agree_bit_for_bit(precision: str, fmt: str) -> None:
    """Every ISA variant performs the same float operations per output: identical results."""
    variants = [v.name for v in supported_variants()]
    n, k = shape_for(fmt)
    w = packed(random_components(FORMATS[fmt], n, k, seed=9))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    outs = {v: cpu_kernels.for_variant(v).quant_linear(x, w, precision) for v in variants}
    first = outs[variants[0]]
    assert all(torch.equal(o, first) for o in outs.values()), variants


@needs_native_kernels
def test_mixed_format_segments() -> None:
    """A fused projection whose row ranges come in different formats (Q4_K_M's q/k/v)."""
    parts = [
        random_components(FORMATS[f], n, 512, seed=i) for i, (f, n) in enumerate([("Q4_K", 20), ("Q6_K", 16)])
    ]
    w = PackedWeight.concat([packed(c) for c in parts])
    assert w.shape == (36, 512) and w.formats == ("Q4_K", "Q6_K")
    ref = torch.cat([reference_weight(c) for c in parts])
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(w.dequantize(torch.tensor([35, 3, 20, 19])), ref[[35, 3, 20, 19]])
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    # Outputs reach ~600 here: float32 sums over 512 terms are within ~1e-6 of that, not 1e-4 absolute
    # (an unseeded x failed that about once in 300 draws).
    torch.testing.assert_close(
        cpu_kernels.quant_linear(x, w, "float32").double(), x.double() @ ref.double().T, atol=2e-3, rtol=1e-5
    )
    # Same-format parts whose seam falls on a tile boundary merge into one segment.
    a, b = (random_components(FORMATS["Q4_1"], 32, 64, seed=s) for s in (1, 2))
    merged = PackedWeight.concat([packed(a), packed(b)])
    assert len(merged.segments) == 1 and torch.equal(
        merged.dequantize(), torch.cat([reference_weight(a), reference_weight(b)])
    )


@needs_native_kernels
def test_kernel_keeps_leading_dims_and_empty_batches() -> None:
    w = packed(random_components(FORMATS["Q4_1"], 8, 64))
    x = torch.randn(2, 3, 64)
    assert cpu_kernels.quant_linear(x, w).shape == (2, 3, 8)
    assert cpu_kernels.quant_linear(x[:0], w).shape == (0, 3, 8)


@needs_native_kernels
def test_wrappers_refuse_what_the_c_code_would_misread() -> None:
    w = packed(random_components(FORMATS["Q4_1"], 8, 64))
    with pytest.raises(ValueError, match="x"):
        cpu_kernels.quant_linear(torch.randn(2, 64).bfloat16(), w)
    with pytest.raises(ValueError, match="last dim"):
        cpu_kernels.quant_linear(torch.randn(2, 32), w)
    with pytest.raises(IndexError):
        w.dequantize(torch.tensor([8]))
    seg = w.segments[0]
    with pytest.raises(ValueError, match="tiles"):
        PackedSegment(seg.fmt, 0, 8, 64, seg.tiles[:, :-1].contiguous())
    with pytest.raises(ValueError, match="whole number"):
        PackedSegment(FORMATS["Q4_K"], 0, 8, 64, seg.tiles)
    with pytest.raises(ValueError, match="consecutive"):
        PackedWeight((seg, seg))


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"])
def test_int8_sums_at_their_largest(variant: str, fmt: str) -> None:
    """Every code at its top (15, 31) against x quantized to +-127 everywhere: the largest integer sums
    a block can have (the AVX2 build adds products in 16 bits: a block's of 4-bit codes, 16 x 15 x 127 =
    30480, and 4 units' of 5-bit ones, 8 x 31 x 127 = 31496, must not wrap)."""
    n, k = shape_for(fmt)
    c = random_components(FORMATS[fmt], n, k, seed=7)
    c.codes.fill_((1 << FORMATS[fmt].bits) - 1)
    w = packed(c)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # signs alternating along k
    x[3] = torch.linspace(-1, 1, k).sign() * 2.5
    got = kernels_for(variant).quant_linear(x, w, "int8").double()
    torch.testing.assert_close(got, int8_reference(x, c), atol=1e-5 * (k / 16) ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "Q5_1", "IQ4_NL"])
@pytest.mark.parametrize("n", [16, 21, 32, 40, 53])
def test_tile_pairs_at_every_edge(variant: str, fmt: str, n: int) -> None:
    """Tiles go two at a time from 32 rows of x on AVX-512 VNNI (pair_tile, pair_tile_super; not Q6_K,
    here as the control): one tile alone, a pair whose second tile is short, an odd tile left alone
    after the pairs, in passes of 4 rows with remainders. Each row equals the int8 reference and itself
    computed alone or among fewer rows (one tile a pass), bit for bit."""
    kern = kernels_for(variant)
    k = 512
    c = random_components(FORMATS[fmt], n, k, seed=11)
    w = packed(c)
    x = torch.randn(35, k, generator=torch.Generator().manual_seed(6))
    got = kern.quant_linear(x, w, "int8")
    torch.testing.assert_close(got.double(), int8_reference(x, c), atol=1e-5 * (k / 16) ** 0.5, rtol=1e-5)
    for m in (3, 11, 32, 33, 34):
        assert torch.equal(kern.quant_linear(x[:m], w, "int8"), got[:m]), f"{m} rows"
    for r in (0, 4, 34):
        assert torch.equal(kern.quant_linear(x[r : r + 1], w, "int8"), got[r : r + 1]), f"row {r} alone"


@pytest.mark.parametrize("variant", EVERY_VARIANT)
@pytest.mark.parametrize("fmt", ["Q6_K", "Q3_K"])
def test_code_bias_at_its_extremes(variant: str, fmt: str) -> None:
    """Q6_K and Q3_K take x + 128 against their codes made signed, from the bias packed in the header
    (quant_tiles.h: qf_has_bias): codes at both ends of their range, sub-scales at both ends of int8,
    x at +-127 with every sign pattern, at the 12-row kernel's row counts. Each row equals the int8
    reference, and itself computed alone, bit for bit."""
    kern = kernels_for(variant)
    f = FORMATS[fmt]
    n, k = shape_for(fmt)
    top = (1 << f.bits) - 1
    for codes, scale in ((0, -128), (top, -128), (0, 127), (top, 127)):
        c = random_components(f, n, k, seed=3)
        c.codes.fill_(codes)
        c.codes[1::3] = top - codes  # rows of the other extreme beside them
        c.sub_scale.fill_(scale)
        w = packed(c)
        x = torch.ones(14, k)
        x[1] = -1.0
        x[2, ::2] = -1.0
        x[3] = torch.linspace(-1, 1, k).sign() * 2.5
        x[4:] = torch.randn(10, k, generator=torch.Generator().manual_seed(codes + scale))
        got = kern.quant_linear(x, w, "int8")
        torch.testing.assert_close(got.double(), int8_reference(x, c), atol=1e-5 * (k / 16) ** 0.5, rtol=1e-5)
        for m in (1, 12, 13):
            assert torch.equal(kern.quant_linear(x[-m:], w, "int8"), got[-m:]), f"{m} rows"
