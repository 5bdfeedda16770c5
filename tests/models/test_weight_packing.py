"""Group-int8 weight packing: the C kernel, exact detection of GGUF block formats, and packed models
computing what their float32 twins compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import gguf_roundtrip
from kernel_marks import needs_native_kernels

from models.kernels import cpu as cpu_kernels
from models.layers.packed_weight import PackedWeight, pack_exact
from models.loader import load_model
from models.weight_packing import pack_model_weights, packable_layers, should_pack


def random_packed(n: int, k: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // 32, generator=g)
    zeros = torch.randn(n, k // 32, generator=g)
    return PackedWeight(codes, scales, zeros)


@needs_native_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 11, 13, 14, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (37, 96), (64, 1536)])
def test_kernel_matches_float_matmul(m: int, n: int, k: int) -> None:
    # m: the streaming path (<= 8 rows), then the outer-product one with every tail of its 6-row
    # micro-tile and more rows than one 96-row block; n = 37: two 16-row tiles, a 4-row and a 1-row
    # tail (the dot-product paths); k = 1536 spans several column chunks of every path.
    w = random_packed(n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = cpu_kernels.group_int8_linear(x, w)
    expect = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got.double(), expect, atol=1e-4 * k**0.5, rtol=1e-5)


@needs_native_kernels
def test_kernel_keeps_leading_dims_and_empty_batches() -> None:
    w = random_packed(8, 64)
    x = torch.randn(2, 3, 64)
    assert cpu_kernels.group_int8_linear(x, w).shape == (2, 3, 8)
    assert cpu_kernels.group_int8_linear(x[:0], w).shape == (0, 3, 8)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
def test_gguf_blocks_are_packed_bit_exactly(qtype: str) -> None:
    weight = gguf_roundtrip(torch.randn(48, 256) * 0.05, qtype)
    packed = pack_exact(weight)
    assert packed is not None
    assert torch.equal(packed.dequantize(), weight)
    assert packed.nbytes * 3 < weight.numel() * 4


def test_formats_may_differ_per_group() -> None:
    a = gguf_roundtrip(torch.randn(4, 64), "Q4_1")
    b = gguf_roundtrip(torch.randn(4, 64), "Q8_0")
    weight = torch.cat([a, b], dim=1)  # groups 0-1 Q4_1, groups 2-3 Q8_0
    packed = pack_exact(weight)
    assert packed is not None and torch.equal(packed.dequantize(), weight)


def test_float_weights_stay_float() -> None:
    assert pack_exact(torch.randn(16, 64)) is None  # an ordinary float checkpoint
    almost = gguf_roundtrip(torch.randn(16, 64), "Q4_1")
    almost[9, 40] = torch.nextafter(almost[9, 40], torch.tensor(1e9))  # one weight off by one ulp
    assert pack_exact(almost) is None
    assert pack_exact(torch.randn(4, 48)) is None  # columns not a multiple of the group
    assert pack_exact(torch.randn(4, 64).bfloat16()) is None
    nan = gguf_roundtrip(torch.randn(4, 64), "Q8_0")
    nan[0, 0] = float("nan")
    assert pack_exact(nan) is None


def test_zero_groups_pack() -> None:
    weight = gguf_roundtrip(torch.randn(4, 64), "Q4_1")
    weight[1] = 0.0
    packed = pack_exact(weight)
    assert packed is not None and torch.equal(packed.dequantize(), weight)


def test_packing_only_on_cpu_float32() -> None:
    cpu = torch.device("cpu")
    assert not should_pack("off", cpu, torch.float32)
    assert not should_pack("auto", cpu, torch.bfloat16)
    assert not should_pack("auto", torch.device("cuda"), torch.float32)
    assert should_pack("auto", cpu, torch.float32) == cpu_kernels.available()
    with pytest.raises(ValueError, match="weight_packing"):
        should_pack("int4", cpu, torch.float32)


@needs_native_kernels
def test_gguf_model_is_packed_and_computes_the_same(tiny_gguf_llama_dir: Path) -> None:
    packed = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="auto")
    plain = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="off")
    layers = packable_layers(packed)
    assert layers and all(layer.packed is not None for layer in layers)
    # Float copies are dropped, except the tied head's, which the embedding lookup still reads.
    assert packed.lm_head.weight is packed.model.embed_tokens.weight
    assert all(layer.weight is None for layer in layers if layer is not packed.lm_head)
    assert all(layer.packed is None for layer in packable_layers(plain))
    for a, b in zip(layers, packable_layers(plain), strict=True):
        assert torch.equal(a.packed.dequantize(), b.weight)
    x = torch.randn(5, packed.config.hidden_size)
    for a, b in zip(layers, packable_layers(plain), strict=True):
        xin = torch.randn(5, a.packed.shape[1])
        torch.testing.assert_close(a.matmul(xin), b.matmul(xin), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), atol=1e-4, rtol=1e-5)


def test_random_float_model_is_left_alone(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.float32, "cpu")
    summary = pack_model_weights(model)
    assert summary.packed == 0 and summary.layers == len(packable_layers(model))
    assert all(layer.weight is not None for layer in packable_layers(model))
