"""The paged KV cache: allocated once at start-up, cut into fixed-size blocks.

Which blocks are free is the scheduler's business (pure Python); the engine only receives block
tables and writes through slot ids (block_id * block_size + offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import CPU_DEFAULT_KV_BYTES, CUDA_KV_MEMORY_FRACTION, EngineConfig
from models.layers.metadata import KVCache


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-token shape of the cache: what a block costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class PagedKVCache:
    """Owns the K and V tensors, [num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim] each.

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
        shape = (spec.num_layers, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: padded block-table entries point at block 0, and a kernel that reads it
        # (masked out) must not meet NaNs from uninitialised memory.
        self.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        # Per-layer views, no copies: [num_blocks + 1, block_size, num_kv_heads, head_dim] each.
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
    one tensor shard when parallel) and how many blocks the configured budget buys."""
    spec = KVCacheSpec(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=config.block_size,
        dtype=dtype,
    )
    if config.num_kv_blocks is not None:
        return spec, config.num_kv_blocks
    budget = config.kv_cache_memory or default_kv_budget(
        device, CPU_DEFAULT_KV_BYTES, CUDA_KV_MEMORY_FRACTION
    )
    return spec, spec.num_blocks_for(budget)
