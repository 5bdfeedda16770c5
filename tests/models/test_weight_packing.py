"""Weight packing: exact detection of GGUF block formats in float32 weights, the --weight-packing
modes, and packed models computing what their float32 twins compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import build_hf_model, gguf_roundtrip, single_seq_logits, tiny_llama_config, write_tiny_gguf
from kernel_marks import needs_native_kernels

from models.kernels import cpu as cpu_kernels
from models.layers.packed_weight import pack_exact
from models.loader import load_model, resolve_model
from models.weight_packing import (
    describe_cpu_setup,
    linear_precision,
    pack_model_weights,
    packable_layers,
    should_pack,
)


@needs_native_kernels
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_1", 5.0), ("Q8_0", 8.5), ("Q4_0", 4.5)])
def test_gguf_blocks_are_packed_bit_exactly(qtype: str, bits: float) -> None:
    weight = gguf_roundtrip(torch.randn(48, 256) * 0.05, qtype)
    packed = pack_exact(weight)
    assert packed is not None and packed.formats == (qtype,)
    assert torch.equal(packed.dequantize(), weight)
    assert packed.nbytes == weight.numel() * bits / 8  # the file's size: 48 rows are 3 whole tiles


@needs_native_kernels
def test_formats_may_differ_per_row() -> None:
    """A fused projection of differently quantized tensors: one segment per run of rows."""
    a = gguf_roundtrip(torch.randn(20, 64), "Q4_1")
    b = gguf_roundtrip(torch.randn(5, 64), "Q8_0")
    weight = torch.cat([a, b, a[:3]])
    packed = pack_exact(weight)
    assert packed is not None and [s.rows for s in packed.segments] == [20, 5, 3]
    assert torch.equal(packed.dequantize(), weight)
    mixed = torch.cat([a[:4], b[:4]], dim=1)  # formats differing along a row: not a GGUF tensor
    assert pack_exact(mixed) is None


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


@needs_native_kernels
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
    for mode in ("auto", "int8", "float32"):
        assert should_pack(mode, cpu, torch.float32) == cpu_kernels.available()
    assert [linear_precision(m) for m in ("auto", "int8", "float32", "off")] == [
        "int8",
        "int8",
        "float32",
        None,
    ]
    with pytest.raises(ValueError, match="weight_packing"):
        should_pack("int4", cpu, torch.float32)


@needs_native_kernels
def test_gguf_model_is_packed_and_computes_the_same(tiny_gguf_llama_dir: Path) -> None:
    packed = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="float32")
    plain = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="off")
    layers = packable_layers(packed)
    assert layers and all(layer.packed is not None for layer in layers)
    # Float copies are dropped; the tied head multiplies by the embedding's packed table.
    assert packed.lm_head.packed is packed.model.embed_tokens.packed
    assert all(layer.weight is None for layer in layers)
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


@needs_native_kernels
def test_int8_activations_by_default(tiny_gguf_llama_dir: Path) -> None:
    fast = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="auto")
    exact = load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="float32")
    assert {layer.precision for layer in packable_layers(fast)} == {"int8"}
    assert {layer.precision for layer in packable_layers(exact)} == {"float32"}
    x = torch.randn(5, fast.config.hidden_size)
    a, b = fast.compute_logits(x), exact.compute_logits(x)
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.02 * b.abs().max()
    line = describe_cpu_setup(fast)
    assert cpu_kernels.kernels().name in line and "Q4_1" in line and "Q8_0" in line and "int8" in line
    assert "decode steps: 2 layers in one native call" in line


@needs_native_kernels
def test_16_bit_values_pack_as_themselves() -> None:
    """Weights that are all bfloat16 (else float16) values, read as float32, keep 2 bytes each and
    multiply float32 activations exactly whatever precision is asked: the raw kind has no int8 path."""
    w16 = (torch.randn(40, 96) * 0.05).half().float()
    packed = pack_exact(w16)
    assert packed is not None and packed.formats == ("F16",) and torch.equal(packed.dequantize(), w16)
    wide = (torch.randn(40, 96) * 1e6).bfloat16().float()  # past float16's range: bfloat16 only
    packed_bf = pack_exact(wide)
    assert (
        packed_bf is not None and packed_bf.formats == ("BF16",) and torch.equal(packed_bf.dequantize(), wide)
    )
    assert packed_bf.nbytes == 48 * 96 * 2  # 40 rows padded to three 16-row tiles
    x = torch.randn(7, 96)
    exact = x.double() @ w16.double().T
    for precision in ("int8", "float32"):
        got = cpu_kernels.quant_linear(x, packed, precision)
        assert torch.equal(got, cpu_kernels.quant_linear(x, packed, "float32"))
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


@needs_native_kernels
def test_16_bit_checkpoint_is_packed_at_its_size(tmp_path: Path) -> None:
    """A checkpoint kept in bfloat16, as most HF checkpoints are, read as float32: every linear packed
    as its own 16-bit values (none left as float32: half the bytes, and the decode steps' layers in one
    native call), computing the float32 modules' logits up to summation order."""
    build_hf_model(tiny_llama_config()).to(torch.bfloat16).save_pretrained(tmp_path)
    packed = load_model(tmp_path, torch.float32, "cpu", weight_packing="auto")
    plain = load_model(tmp_path, torch.float32, "cpu", weight_packing="off")
    layers = packable_layers(packed)
    assert layers and all(layer.packed is not None for layer in layers)
    assert {f for layer in layers for f in layer.packed.formats} <= {"F16", "BF16"}
    for a, b in zip(layers, packable_layers(plain), strict=True):
        assert torch.equal(a.packed.dequantize(), b.weight) and a.packed.nbytes == 2 * b.weight.numel()
    assert packed.native_decode is not None
    x = torch.randn(5, packed.config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), atol=1e-4, rtol=1e-5)
    ids = [1, 70, 80, 90, 100, 7]
    torch.testing.assert_close(
        single_seq_logits(packed, ids), single_seq_logits(plain, ids), atol=1e-4, rtol=1e-4
    )


@needs_native_kernels
def test_f16_gguf_is_packed_as_f16(tmp_path: Path, monkeypatch) -> None:
    """An F16 GGUF's linears keep the file's 2 bytes a weight on the native kernels (they were read as
    float32: twice the memory, and torch's matmuls)."""
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "f16.gguf"
    write_tiny_gguf(
        gguf,
        hidden=64,
        ff=128,
        heads=4,
        kv_heads=2,
        layers=2,
        types=dict.fromkeys(("attn", "ffn", "token_embd"), "F16"),
    )
    path = resolve_model(str(gguf))
    packed = load_model(path, torch.float32, "cpu")
    plain = load_model(path, torch.float32, "cpu", weight_packing="off")
    layers = packable_layers(packed)
    assert layers and {f for layer in layers for f in layer.packed.formats} == {"F16"}
    assert packed.native_decode is not None
    assert "with float32 activations" in describe_cpu_setup(packed)  # F16 has no int8 path
    ids = [1, 70, 80, 90, 100, 7]
    torch.testing.assert_close(
        single_seq_logits(packed, ids), single_seq_logits(plain, ids), atol=1e-4, rtol=1e-4
    )
