"""Codes and scales -> a K-quant's raw GGUF blocks: the inverse of blocks.decode_blocks, byte for byte as
ggml lays them out (its quantize_row_q*_K_ref's packing, without the search for the best scales).

gguf-py quantizes only the legacy types (Q4_0 ... Q8_0); this writes the K-quants (Q2_K ... Q6_K), the
types of llama.cpp's Q2_K, Q3_K_M, Q4_K_M and Q5_K_M mixes, from codes and scales that are given (random
ones for files at a model's shape: loadtest/gguf_shapes.py). `decode_blocks(t, encode(t, c), k)` gives back `c`
(tests/models/test_gguf_native.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.layers.packed_weight import BlockComponents

ENCODABLE = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float16 [n, nb] -> bytes [n, nb, 2]."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 6-bit sc and m [n, nb, 8] -> the 12 packed bytes (get_scale_min_k4's layout):
    bytes 0..3 hold sc 0..3 and 4..7 m 0..3 in their low 6 bits; sub-blocks 4..7 keep their low 4 bits
    in bytes 8..11 (sc low nibble, m high) and their top 2 bits in the top bits of bytes 0..7."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, nb, 8, 32] codes 0..15 -> [n, nb, 128]: sub-block 2i in the low nibbles of bytes 32i..32i+31,
    2i + 1 in their high nibbles."""
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)


def _k_crumbs(q: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K codes, Q6_K's high bits: [n, nb, 256 (any shape)] values 0..3 -> [n, nb, 64]: byte 32c + j holds
    weights 128c + 32s + j in bits 2s, 2s + 1 (s = 0..3)."""
    q = q.astype(np.uint8).reshape(*q.shape[:2], 2, 4, 32)
    out = q[:, :, :, 0] | (q[:, :, :, 1] << 2) | (q[:, :, :, 2] << 4) | (q[:, :, :, 3] << 6)
    return out.reshape(*q.shape[:2], 64)


def _k_bits(b: np.ndarray) -> np.ndarray:
    """Q3_K's hmask, Q5_K's qh: [n, nb, 8, 32] bits -> [n, nb, 32]: sub-block s's bit of weight j at bit s
    of byte j."""
    out = np.zeros((*b.shape[:2], 32), dtype=np.uint8)
    for s in range(8):
        out |= b[:, :, s].astype(np.uint8) << s
    return out


def _q3_k_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K: int8 sub-scales [n, nb, 16] (-32..31, stored + 32) -> the 12 packed bytes: the low 4 bits of
    sub-scales j and 8 + j in byte j (low, high nibble), the top 2 bits of sub-scale 4s + j in bits 2s,
    2s + 1 of byte 8 + j."""
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    low = (u[..., 0:8] & 0x0F) | ((u[..., 8:16] & 0x0F) << 4)
    top = (u >> 4).reshape(*u.shape[:-1], 4, 4)  # (s, j)
    high = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return np.concatenate([low, high], axis=-1)


def encode(ggml_type: str, c: BlockComponents) -> np.ndarray:
    """uint8 [N, row bytes] blocks of one tensor from its codes and scales (the components
    blocks.decode_blocks would return for them)."""
    if ggml_type not in ENCODABLE or c.fmt.name != ggml_type:
        raise ValueError(f"cannot encode {c.fmt.name} components as {ggml_type}; encodable: {ENCODABLE}")
    n, k = c.shape
    nb = k // 256
    codes = c.codes.numpy().astype(np.int16).reshape(n, nb, 8, 32)
    d = _f16_bytes(c.scale.numpy())  # [n, nb, 2]
    if ggml_type == "Q2_K":  # scales (sc low nibble, m high) per 16, 2-bit codes, d, dmin
        sc = c.sub_scale.numpy().reshape(n, nb, 16) | (c.sub_min.numpy().reshape(n, nb, 16) << 4)
        parts = [sc.astype(np.uint8), _k_crumbs(codes), d, _f16_bytes(c.minimum.numpy())]
        return np.concatenate(parts, axis=-1).reshape(n, -1)
    if ggml_type == "Q3_K":  # hmask (weight 32s + j's third bit at bit s of byte j), 2-bit codes, scales, d
        q = codes.astype(np.uint8)
        sc = _q3_k_scales(c.sub_scale.numpy().reshape(n, nb, 16))
        parts = [_k_bits((q >> 2) & 1), _k_crumbs(q & 0x03), sc, d]
        return np.concatenate(parts, axis=-1).reshape(n, -1)
    if ggml_type == "Q6_K":
        q = codes.astype(np.uint8).reshape(n, nb, 2, 2, 64)  # (128-chunk, nibble shift, l)
        ql = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)  # [n, nb, 2, 64]
        sc = c.sub_scale.numpy().astype(np.int8).view(np.uint8).reshape(n, nb, 16)
        parts = [ql.reshape(n, nb, 128), _k_crumbs(q >> 4), sc, d]
    else:
        q = codes.astype(np.uint8)
        scales = _k_scales(c.sub_scale.numpy().reshape(n, nb, 8), c.sub_min.numpy().reshape(n, nb, 8))
        parts = [d, _f16_bytes(c.minimum.numpy()), scales]
        if ggml_type == "Q5_K":
            parts.append(_k_bits((q >> 4) & 1))
        parts.append(_k_nibbles(q & 0x0F))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def add_arch_metadata(writer: Any, arch: str, values: dict[str, Any]) -> None:
    """`{arch}.{key}` entries of a gguf.GGUFWriter, typed by value: bool, uint32, float32, string or
    array (what writers of synthetic files, the benchmarks' and the tests', set beyond the standard keys)."""
    for key, value in values.items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_array(name, list(value))


def add_decoder_hparams(
    writer: Any,
    layers: int,
    context: int,
    hidden: int,
    ff: int,
    heads: int,
    kv_heads: int,
    rope_theta: float,
    rms_eps: float,
    *,
    vocab: int | None = None,
    rotary_dim: int | None = None,
    head_dim: int | None = None,
    experts: int = 0,
    experts_used: int = 0,
    expert_ff: int = 0,
) -> None:
    """A decoder's standard hyperparameters in a gguf.GGUFWriter, as llama.cpp's converter names them
    (for writers of synthetic files, the benchmarks' and the tests'): the sizes, the rope base and the
    norm epsilon; the vocabulary size and rope.dimension_count where given; attention.key_length and
    value_length where `head_dim` is; the experts' count, top k and width where `experts`."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(rms_eps)
    if vocab is not None:
        writer.add_vocab_size(vocab)
    if rotary_dim is not None:
        writer.add_rope_dimension_count(rotary_dim)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(experts_used)
        writer.add_expert_feed_forward_length(expert_ff)
