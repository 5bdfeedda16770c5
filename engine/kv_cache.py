"""The paged KV cache: allocated once at start-up, cut into fixed-size blocks.

Which blocks are free is the scheduler's business (pure Python); the engine only receives block
tables and writes through slot ids (block_id * block_size + offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.config import CPU_DEFAULT_KV_BYTES, CUDA_KV_MEMORY_FRACTION, EngineConfig
from models.layers.kv_format import KVFormat, kv_format
from models.layers.metadata import KVCache


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-token shape of the cache: what a block costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    format: KVFormat  # what a row holds (--kv-cache-dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The cache tensors' dtype (uint8 for q8_0)."""
        return self.format.storage

    @property
    def row_width(self) -> int:
        """Elements of `dtype` per token per KV head."""
        return self.format.row_width(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


# Backends whose kernels read K/V in the queries' dtype only (the GPU ones; Triton also in its CPU
# interpreter, which is how tests run it).
SAME_DTYPE_BACKENDS = frozenset({"triton", "flash-attn", "torch-varlen"})


def resolve_kv_format(
    name: str, device: torch.device, model_dtype: torch.dtype, head_dim: int, attention_backend: str = "auto"
) -> KVFormat:
    """The format --kv-cache-dtype names. "auto" is 16-bit on a CPU: the model's dtype where that is
    bfloat16 (a float checkpoint on a CPU with bf16 units: its torch paths then gather the cache with
    no conversion), else float16. Measured on the native decode-attention kernel (4096 tokens of
    context, SmolLM2-135M's 30 layers, one thread, AVX-512 + BF16 EPYC, the avx2 and avx512_vnni
    builds): float16 and bfloat16 both took 0.69-0.71x float32's time, equal within noise (widening
    is one vcvtph2ps or a shift; neither is where the time goes), and float16 keeps 3 more mantissa
    bits (the kernel's error against float32 attention: 1.3e-3 against 7.8e-3; with int8 activations
    the default model's teacher-forced agreement with float32 stays at 97.3% over a float16 cache and
    falls to 94.9% over a bfloat16 one), as llama.cpp's default f16 cache does. On CUDA, and with an
    attention backend whose kernels read K/V in the queries' dtype (Triton, flash-attn, torch varlen),
    it is the model's dtype, and another type is refused there with the reason."""
    if device.type == "cuda" or attention_backend in SAME_DTYPE_BACKENDS:
        model_name = str(model_dtype).removeprefix("torch.")
        where = "on CUDA" if device.type == "cuda" else f"with the {attention_backend} attention backend"
        if name == "auto":
            name = model_name
        elif name == "q8_0":
            raise ValueError(
                f"--kv-cache-dtype q8_0 is read by the native CPU kernels only; {where} the KV cache holds "
                f"the model's dtype: use auto (here {model_name})"
            )
        elif name != model_name:
            raise ValueError(
                f"{where} the KV cache holds the model's dtype ({model_name}): --kv-cache-dtype {name} "
                f"needs --dtype {name}, or use auto"
            )
    elif name == "auto":
        name = "bfloat16" if model_dtype == torch.bfloat16 else "float16"
    fmt = kv_format(name)
    fmt.check_head_dim(head_dim)
    return fmt


class PagedKVCache:
    """Owns the K and V tensors, [num_layers, num_blocks + 1, block_size, num_kv_heads, row] each: rows
    of head_dim values of the cache's dtype, or of head_dim / 32 q8_0 blocks (uint8, 34 bytes each).

    Blocks 0 .. num_blocks - 1 are the scheduler's to hand out. One more, `scratch_block`, is never
    handed out: the padding rows of a CUDA-graph decode step (engine/cuda_graphs.py) write their K/V
    there and attend to it, so a batch padded up to its graph's size never touches a real sequence's
    blocks.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"the KV budget holds {num_blocks} blocks of {spec.bytes_per_block} bytes; give it more memory"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (spec.num_layers, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.row_width)
        # zeros, not empty: padded block-table entries point at block 0, and a kernel that reads it
        # (masked out) must not meet NaNs from uninitialised memory.
        self.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        # Per-layer views, no copies: [num_blocks + 1, block_size, num_kv_heads, row] each.
        self.layers: list[KVCache] = [(self.k_cache[i], self.v_cache[i]) for i in range(spec.num_layers)]

    @property
    def scratch_block(self) -> int:
        """The block no sequence owns (the last one): padding rows of graph steps write and read it."""
        return self.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """What the scheduler's blocks hold (the scratch block adds one block more)."""
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        """The start-up line: the type, the tokens that fit, and what float32 would fit in the same bytes."""
        spec = self.spec
        f32 = replace(spec, format=kv_format("float32"))
        f32_tokens = self.total_bytes // f32.bytes_per_block * spec.block_size
        return (
            f"KV cache: {spec.format.name}, {self.num_blocks} blocks of {spec.block_size} tokens = "
            f"{self.num_slots} tokens in {self.total_bytes / 2**20:.1f} MiB "
            f"({spec.bytes_per_token} bytes a token; float32 would fit {f32_tokens} tokens in these bytes: "
            f"{f32.bytes_per_token / spec.bytes_per_token:.2f}x as many a byte here)"
        )


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The KV slot of one token position in a sequence."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_of(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions start..end-1 of one sequence (slot_of for each), a range per block."""
    slots: list[int] = []
    pos = start
    while pos < end:
        first = block_table[pos // block_size] * block_size + pos % block_size
        n = min(block_size - pos % block_size, end - pos)
        slots.extend(range(first, first + n))
        pos += n
    return slots


def slot_mapping(
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_index: torch.Tensor,  # [T] int64: which row of block_tables each token belongs to
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:
    """Slots of many tokens at once: [T] int64."""
    blocks = block_tables[seq_index, positions // block_size].long()  # [T]
    return blocks * block_size + positions % block_size


def default_kv_budget(device: torch.device, cpu_budget: int, cuda_fraction: float) -> int:
    """Bytes for the cache when the config names neither a block count nor a byte budget.

    On CUDA, call it after the weights are loaded: it takes a fraction of what is still free.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * cuda_fraction)
    return cpu_budget


def plan_kv_cache(
    model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> tuple[KVCacheSpec, int]:
    """The cache shape this process needs for `model` (its layers and KV heads: one pipeline stage and
    one tensor shard when parallel; the model's `dtype`) and how many blocks the configured budget buys:
    a smaller --kv-cache-dtype buys more blocks of the same bytes."""
    spec = KVCacheSpec(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=config.block_size,
        format=resolve_kv_format(
            config.kv_cache_dtype, device, dtype, model.head_dim, config.attention_backend
        ),
    )
    if config.num_kv_blocks is not None:
        return spec, config.num_kv_blocks
    budget = config.kv_cache_memory or default_kv_budget(
        device, CPU_DEFAULT_KV_BYTES, CUDA_KV_MEMORY_FRACTION
    )
    return spec, spec.num_blocks_for(budget)
