"""What the paged KV cache stores, and the torch side of reading and writing it (--kv-cache-dtype).

A cache tensor is [num_blocks, block_size, num_kv_heads, row]: float32, float16 and bfloat16 rows are
head_dim values of that dtype; a q8_0 cache is uint8 and each row is head_dim / 32 of llama.cpp's
block_q8_0 (34 bytes: an IEEE half scale d, then 32 int8 codes q; the value is q * d). The format of
a cache is read off its tensor (uint8 means q8_0), so the backends need no extra argument.

The native kernels (models/kernels/kv_types.h) read every format in place and write it in the cache
write of rotary + cache; the torch paths here are for everything else: the per-token cache write of
models without the native prologue, and the gathers of the torch attention paths (sdpa over prompt
chunks, the fallbacks without native kernels), which widen only the rows they read. Both sides
quantize with the same IEEE float32 operations (d = max|x| / 127, q = round-half-even(x * (1 / d)),
d rounded to half), so a cache written by either is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kernels.cpu import Q8_0_BYTES, Q8_0_VALUES, kv_row_width  # the layout kv_types.h reads
from models.options import KV_CACHE_DTYPES


@dataclass(frozen=True)
class KVFormat:
    """One --kv-cache-dtype: the tensor dtype a cache holds and the row width per head."""

    name: str
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` per KV head per token (the kernels' rule, kv_row_width)."""
        self.check_head_dim(head_dim)
        width = kv_row_width(self.storage, head_dim)
        assert width is not None  # every format here is one the kernels lay out
        return width

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantized and head_dim % Q8_0_VALUES:
            raise ValueError(
                f"--kv-cache-dtype q8_0 needs a head_dim that is a multiple of {Q8_0_VALUES}; "
                f"this model's is {head_dim} (use float16 or bfloat16)"
            )


_FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "float16": KVFormat("float16", torch.float16),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "q8_0": KVFormat("q8_0", torch.uint8),
}
assert tuple(_FORMATS) == KV_CACHE_DTYPES


def kv_format(name: str) -> KVFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV cache dtype {name!r}; one of auto, {', '.join(KV_CACHE_DTYPES)}"
        ) from None


def format_of(cache: torch.Tensor) -> KVFormat:
    """The format of a cache tensor (uint8 is q8_0)."""
    for f in _FORMATS.values():
        if f.storage == cache.dtype:
            return f
    raise ValueError(f"a KV cache of dtype {cache.dtype} is none of {', '.join(KV_CACHE_DTYPES)}")


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D / 32 * 34] uint8 q8_0 blocks (D a multiple of 32)."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(*lead, d // Q8_0_VALUES, Q8_0_VALUES)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inv).to(torch.int8)
    half = scale.to(torch.float16)
    raw = torch.cat([half.view(torch.uint8), codes.view(torch.uint8)], dim=-1)  # [..., D/32, 34]
    return raw.reshape(*lead, d // Q8_0_VALUES * Q8_0_BYTES)


def dequantize_q8_0(raw: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D / 32 * 34] uint8 q8_0 blocks -> [..., D] of `dtype` (computed in float32)."""
    lead = raw.shape[:-1]
    blocks = raw.reshape(*lead, head_dim // Q8_0_VALUES, Q8_0_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., D/32, 1]
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (codes * scale).reshape(*lead, head_dim).to(dtype)


def encode(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows x [..., D] in the cache's format (a no-op when the dtypes already match)."""
    if cache.dtype == torch.uint8:
        return quantize_q8_0(x)
    return x.to(cache.dtype)


def decode(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache ([..., row]) as [..., head_dim] of `dtype` (the queries')."""
    if rows.dtype == torch.uint8:
        return dequantize_q8_0(rows, head_dim, dtype)
    return rows.to(dtype)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache.view(-1, Hkv, row)[slots] = x ([T, Hkv, D]) in the cache's format."""
    hkv = x.shape[1]
    cache.view(-1, hkv, cache.shape[-1]).index_copy_(0, slots, encode(x, cache))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """cache.view(-1, Hkv, row)[slots] as [..., Hkv, head_dim] of `dtype`: only these rows are widened."""
    hkv = cache.shape[-2]
    return decode(cache.view(-1, hkv, cache.shape[-1])[slots], head_dim, dtype)
