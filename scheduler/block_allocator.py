"""The KV block allocator: which of the engine's `num_kv_blocks` cache blocks each request holds."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    pass


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list over block ids 0..num_blocks-1: O(1) per block taken, appended or freed.

    Freed blocks go to the back of the queue and are taken from the front, so a block is reused as
    late as possible (stale K/V from a finished request is not read back by a scheduling bug soon).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # A double free or a free of a block never handed out would corrupt another request's cache
        # silently; one byte per block makes it an immediate error instead.
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._in_use[b] = 1
        return blocks

    def append_blocks(self, block_table: list[int], n: int) -> None:
        """Grow a request's block table by n blocks (all or none)."""
        block_table.extend(self.allocate(n))

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` to hold num_tokens tokens. False (and nothing taken) if too few are free."""
        missing = blocks_for_tokens(num_tokens, self.block_size) - len(block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        self.append_blocks(block_table, missing)
        return True

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if not self._in_use[b]:
                raise ValueError(f"KV block {b} freed but not in use")
            self._in_use[b] = 0
            self._free.append(b)
