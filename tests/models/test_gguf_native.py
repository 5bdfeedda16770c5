"""Quantized GGUF files loaded natively: every block type decodes to gguf-py's values, a converted file
is read in place with its quantized tensors packed straight from their blocks (never expanded to
float32), and the result equals what transformers' GGUF loader builds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from builders import gguf_blocks, single_seq_logits, write_tiny_gguf
from kernel_marks import needs_native_kernels

from models.errors import ModelLoadError
from models.gguf.blocks import decodable, decode_blocks
from models.gguf.encode import ENCODABLE, encode
from models.gguf.reader import MANIFEST, QuantizedTensor
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.layers.packed_weight import FORMATS, PackedWeight, pack_components, random_components
from models.layers.parallel import TPContext
from models.loader import load_model, resolve_model
from models.weight_packing import packable_layers

LEGACY = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q5_0",
    "ffn_gate": "Q5_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
}
# Q4_K_M-like: K-quants, with q/k/v in different formats (one fused projection, two segments).
KQUANTS = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q4_K",
    "output.": "Q6_K",
}
# Q3_K_M / Q2_K / IQ4_XS-like: the low-bit K-quants and the non-linear codebook types (IQ4_NL: what
# an IQ4_XS file holds for rows that are not whole super-blocks), mixed in one fused projection too.
LOW_BITS = {
    "attn_q": "Q3_K",
    "attn_k": "Q2_K",
    "attn_v": "IQ4_XS",
    "attn_output": "IQ4_NL",
    "ffn_gate": "Q2_K",
    "ffn_up": "IQ4_XS",
    "ffn_down": "Q3_K",
    "token_embd": "IQ4_XS",
    "output.": "Q2_K",
}
# A type without a native decoder (IQ3_S) inside a fused projection: that layer falls back to floats.
FALLBACK = {**KQUANTS, "ffn_up": "IQ3_S"}
SIZES = {
    "legacy": dict(hidden=64, ff=128),
    "kquants": dict(hidden=256, ff=512),
    "low-bits": dict(hidden=256, ff=512),
    "fallback": dict(hidden=256, ff=512),
}
MIXES = {
    "legacy": (LEGACY, True),
    "kquants": (KQUANTS, False),
    "low-bits": (LOW_BITS, False),
    "fallback": (FALLBACK, False),
}


@needs_native_kernels
@pytest.mark.parametrize("qtype", [name for name in FORMATS if decodable(name)])  # F16/BF16 come as floats
def test_blocks_decode_to_gguf_py_values(qtype: str) -> None:
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    k = 512
    raw = gguf_blocks((rng.standard_normal((21, k)) * 0.1).astype(np.float32), qtype, rng)
    expect = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).copy())
    packed = PackedWeight((pack_components(decode_blocks(qtype, raw, k)),))
    assert torch.equal(packed.dequantize(), expect)
    # Bits per weight as stored (21 rows pad to two 16-row tiles): the file's, but for the K-quants'
    # 4- and 6-bit sub-scales and minimums kept as bytes (Q4_K, Q5_K, Q2_K, Q3_K) and for Q6_K's and
    # Q3_K's code bias (an int32 per row and 256 weights).
    stored = {
        "Q4_0": 4.5,
        "Q4_1": 5.0,
        "Q8_0": 8.5,
        "Q5_0": 5.5,
        "Q5_1": 6.0,
        "Q4_K": 4.625,
        "Q5_K": 5.625,
        "Q6_K": 6.6875,  # + the code bias
        "Q2_K": 3.125,  # sc and m per 16 as bytes (the file: a nibble each)
        "Q3_K": 3.6875,  # sc per 16 as bytes (the file: 6 bits), + the code bias
        "IQ4_XS": 4.3125,
        "IQ4_NL": 4.5,
    }
    assert 8 * packed.nbytes / (32 * k) == stored[qtype]


@needs_native_kernels
@pytest.mark.parametrize("qtype", ENCODABLE)
def test_encoded_k_quant_blocks_round_trip(qtype: str) -> None:
    """Codes and scales written as a K-quant's blocks (models/gguf/encode.py, for files at a model's
    shape) decode to themselves, and gguf-py reads from them the values they stand for."""
    from gguf import GGMLQuantizationType, quants

    c = random_components(FORMATS[qtype], 21, 512, seed=3)
    raw = encode(qtype, c)
    back = decode_blocks(qtype, raw, 512)
    for field in ("codes", "scale", "minimum", "sub_scale", "sub_min"):
        assert (getattr(c, field) is None) == (getattr(back, field) is None)
        if getattr(c, field) is not None:
            assert torch.equal(getattr(c, field), getattr(back, field)), field
    expect = PackedWeight((pack_components(c),)).dequantize()
    assert torch.equal(torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).copy()), expect)


def _convert(tmp_path: Path, monkeypatch, mix: str) -> Path:
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    types, tied = MIXES[mix]
    gguf_file = tmp_path / f"tiny-{mix}.gguf"
    # Random 2-layer models are chaotic: for some draws float32 summation order alone moves a logit by
    # more than atol 1e-4, or int8 activations by more than 5% (seeds 2, 3 of the K-quant mixes did,
    # with this code and before it); this draw is one where neither happens for any mix.
    write_tiny_gguf(gguf_file, seed=4, heads=4, kv_heads=2, layers=2, types=types, tied=tied, **SIZES[mix])
    path = resolve_model(str(gguf_file))
    assert (path / MANIFEST).is_file() and not list(path.glob("*.safetensors"))
    return path


@needs_native_kernels
@pytest.mark.parametrize("mix", list(MIXES))
def test_quantized_gguf_loads_natively_and_matches_transformers(
    tmp_path: Path, monkeypatch, mix: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = _convert(tmp_path, monkeypatch, mix)
    native = load_model(path, torch.float32, "cpu", weight_packing="float32")
    floats = load_model(path, torch.float32, "cpu", weight_packing="off")
    hf_dir = tmp_path
    gguf_name = f"tiny-{mix}.gguf"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()

    # The float path holds exactly transformers' weights ...
    hf_state = hf.state_dict()
    ours = dict(floats.named_parameters())
    assert torch.equal(ours["model.embed_tokens.weight"], hf_state["model.embed_tokens.weight"])
    qkv = ours["model.layers.1.self_attn.qkv_proj.weight"]
    hf_qkv = [hf_state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(qkv, torch.cat(hf_qkv))  # q and k un-permuted as transformers does
    # ... and every packed weight is bit-identical to the float path's.
    for p, f in zip(packable_layers(native), packable_layers(floats), strict=True):
        if p.packed is not None:
            assert torch.equal(p.packed.dequantize(), f.weight)
        else:
            assert torch.equal(p.weight, f.weight)
    packed_formats = {
        fmt for layer in packable_layers(native) if layer.packed for fmt in layer.packed.formats
    }
    expected = {t for t in MIXES[mix][0].values() if t in FORMATS}
    assert packed_formats == expected
    if mix == "fallback":  # gate (Q4_K) and up (IQ3_S) share one fused weight: kept as floats
        assert native.model.layers[0].mlp.gate_up_proj.packed is None
    assert all(layer.weight is None for layer in packable_layers(native) if layer.packed is not None)

    ids = [1, 70, 80, 90, 100, 7, 8, 200, 2]
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    # float32 in another summation order (torch's matmuls change theirs with the thread count): an
    # error of ~1e-6 of the logits' scale per element, not a fixed 1e-4 whatever the scale.
    atol = max(1e-4, 1e-5 * float(expect.abs().max()))
    torch.testing.assert_close(single_seq_logits(native, ids), expect, atol=atol, rtol=1e-4)
    torch.testing.assert_close(single_seq_logits(floats, ids), expect, atol=atol, rtol=1e-4)
    fast = load_model(path, torch.float32, "cpu", weight_packing="int8")
    got = single_seq_logits(fast, ids)
    assert (got - expect).abs().max() < 0.05 * expect.abs().max()


@needs_native_kernels
def test_tensor_parallel_shards_keep_their_blocks() -> None:
    """Row and column shards of raw blocks, as tensor parallelism cuts them; a column cut through
    K-quant super-blocks falls back to floats for that shard."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(3)
    for qtype, k, split_cols in (("Q4_1", 128, True), ("Q4_K", 512, True), ("Q4_K", 768, False)):
        raw = gguf_blocks((rng.standard_normal((48, k)) * 0.1).astype(np.float32), qtype, rng)
        full = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).copy())
        q = QuantizedTensor(qtype, (48, k), raw)
        for rank in range(2):
            tp = TPContext(rank, 2)
            col = ColumnParallelLinear(k, 48, tp=tp)
            col.weight_loader(col.weight, q)
            assert col.pack_weight("float32") is not None
            assert torch.equal(col.packed.dequantize(), full[rank * 24 : (rank + 1) * 24])
            row = RowParallelLinear(k, 48, tp=tp)
            row.weight_loader(row.weight, q)
            half = k // 2
            packed = row.pack_weight("float32")
            if split_cols:
                assert packed is not None and torch.equal(
                    packed.dequantize(), full[:, rank * half : (rank + 1) * half]
                )
            else:  # 384 columns: not a whole number of 256-weight super-blocks
                assert packed is None and torch.equal(row.weight, full[:, rank * half : (rank + 1) * half])


def test_a_changed_or_missing_gguf_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    path = _convert(tmp_path, monkeypatch, "legacy")
    gguf_file = tmp_path / "tiny-legacy.gguf"
    gguf_file.write_bytes(gguf_file.read_bytes() + b"\0")
    with pytest.raises(ModelLoadError, match="changed since it was converted"):
        load_model(path, torch.float32, "cpu")
    gguf_file.unlink()
    with pytest.raises(ModelLoadError, match="is gone"):
        load_model(path, torch.float32, "cpu")
