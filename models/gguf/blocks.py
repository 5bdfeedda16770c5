"""A GGUF tensor's raw blocks -> the codes and scales the packed kernels store (packed_weight.py).

Each decoder reads the bytes exactly as gguf-py's dequantizer for that type does (same reshapes, same
bit positions), so `pack_components(decode_blocks(...))` reconstructs gguf-py's float32 values bit for bit;
tests/models/test_gguf_native.py checks every type against gguf-py. Types without a decoder here
(the IQ types but IQ4_XS and IQ4_NL, TQ1_0, ...) are dequantized to float by gguf-py instead.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from models.layers.packed_weight import FORMATS, BlockComponents


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes -> float16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles (k 0..15) then the high ones (k 16..31)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bit5(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: [..., 4] bytes (one little-endian uint32) -> [..., 32] fifth bits, bit k for k."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [nb, 128] -> [nb, 8, 32]: 32-byte chunk i holds sub-block 2i (low) and 2i+1 (high)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _k_crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: [n, nb, 64] -> [n, nb, 256] 2-bit fields: byte 32c + j holds weights 128c + 32s + j
    in bits 2s, 2s + 1 (s = 0..3)."""
    n, nb = qs.shape[:2]
    q = qs.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return (q & 0x03).reshape(n, nb, 256)


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K: [n, nb, 12] -> [n, nb, 16] int8 sub-scales (6-bit, stored + 32): the low 4 bits from
    bytes 0..7 (low nibbles, then high), the top 2 from bytes 8..11 (2 bits each, 4 per byte)."""
    n, nb = scales.shape[:2]
    low = scales[..., :8].reshape(n, nb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = scales[..., 8:].reshape(n, nb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    sc = (low.reshape(n, nb, 16) & 0x0F) | ((high.reshape(n, nb, 16) & 0x03) << 4)
    return (sc.astype(np.int16) - 32).astype(np.int8)


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS: blocks [n, nb, 136] -> [n, nb, 8] int8 sub-scales (6-bit, stored + 32): the low 4 bits
    from bytes 4..7 (low nibble, then high), the top 2 from the uint16 at bytes 2..3 (2 bits each)."""
    n, nb = b.shape[:2]
    low = b[..., 4:8].reshape(n, nb, 4, 1) >> np.array([0, 4], dtype=np.uint8)
    high = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)  # [n, nb, 1]
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03  # [n, nb, 8]
    sc = (low.reshape(n, nb, 8) & 0x0F) | (high.astype(np.uint8) << 4)
    return (sc.astype(np.int16) - 32).astype(np.int8)


def decode_blocks(ggml_type: str, raw: np.ndarray, k: int) -> BlockComponents:
    """raw: uint8 [N, row bytes] of one tensor whose rows are k weights long."""
    fmt = FORMATS[ggml_type]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, k // block, size)

    def out(codes: np.ndarray, **parts: torch.Tensor | None) -> BlockComponents:
        dtype = np.uint8 if fmt.unsigned_codes else np.int8
        c = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k).astype(dtype)))
        return BlockComponents(fmt, c, **parts)

    if ggml_type in ("Q4_0", "IQ4_NL"):  # IQ4_NL: the same block, its nibbles index the codebook
        return out(_nibbles(b[..., 2:18]), scale=_f16(b[..., 0:2]))
    if ggml_type == "Q4_1":
        return out(_nibbles(b[..., 4:20]), scale=_f16(b[..., 0:2]), minimum=_f16(b[..., 2:4]))
    if ggml_type == "Q8_0":
        return out(b[..., 2:34].view(np.int8), scale=_f16(b[..., 0:2]))
    if ggml_type == "Q5_0":
        q = _nibbles(b[..., 6:22]) | (_bit5(b[..., 2:6]) << 4)
        return out(q, scale=_f16(b[..., 0:2]))
    if ggml_type == "Q5_1":
        q = _nibbles(b[..., 8:24]) | (_bit5(b[..., 4:8]) << 4)
        return out(q, scale=_f16(b[..., 0:2]), minimum=_f16(b[..., 2:4]))
    if ggml_type in ("Q4_K", "Q5_K"):
        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        q = _k_nibbles(b[..., 16:144] if ggml_type == "Q4_K" else b[..., 48:176])
        if ggml_type == "Q5_K":
            qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = q | ((qh & 1).reshape(n, -1, 8, 32) << 4)
        return out(
            q,
            scale=_f16(b[..., 0:2]),
            minimum=_f16(b[..., 2:4]),
            sub_scale=torch.from_numpy(sc.reshape(n, -1).astype(np.uint8)),
            sub_min=torch.from_numpy(m.reshape(n, -1).astype(np.uint8)),
        )
    if ggml_type == "Q6_K":
        nb = b.shape[1]
        ql = b[..., 0:128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(n, nb, 8, 32)
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        qh = (qh & 0x03).reshape(n, nb, 8, 32)
        q = ql | (qh << 4)
        sc = torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, -1).copy())
        return out(q, scale=_f16(b[..., 208:210]), sub_scale=sc)
    if ggml_type == "Q2_K":
        # scales (per 16 weights: sc low nibble, m high), 2-bit codes, d, dmin; w = d sc q - dmin m
        sc, m = b[..., 0:16] & 0x0F, b[..., 0:16] >> 4
        return out(
            _k_crumbs(b[..., 16:80]),
            scale=_f16(b[..., 80:82]),
            minimum=_f16(b[..., 82:84]),
            sub_scale=torch.from_numpy(np.ascontiguousarray(sc).reshape(n, -1)),
            sub_min=torch.from_numpy(np.ascontiguousarray(m).reshape(n, -1)),
        )
    if ggml_type == "Q3_K":
        # hmask (third bit, set where the -4 offset is not taken), 2-bit codes, scales, d:
        # q = low - 4 (1 - high), stored as q + 4 = low + 4 high
        nb = b.shape[1]
        high = b[..., 0:32].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        q = _k_crumbs(b[..., 32:96]) | ((high & 1).reshape(n, nb, 256) << 2)
        sc = torch.from_numpy(_q3_k_scales(b[..., 96:108]).reshape(n, -1))
        return out(q, scale=_f16(b[..., 108:110]), sub_scale=sc)
    if ggml_type == "IQ4_XS":
        # d, scales (high bits), scales (low bits), codebook indices: 32 per sub-block, low nibbles first
        q = b[..., 8:136].reshape(n, -1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        sc = torch.from_numpy(_iq4_xs_scales(b).reshape(n, -1))
        return out(q & 0x0F, scale=_f16(b[..., 0:2]), sub_scale=sc)
    raise ValueError(f"no block decoder for {ggml_type}")


def decodable(ggml_type: str) -> bool:
    """Whether a quantized type's blocks are kept and packed as they are (F16 and BF16 tensors are read
    as floats, and packed from those: packed_weight.float16_components)."""
    return ggml_type in FORMATS and FORMATS[ggml_type].kind != "raw"
