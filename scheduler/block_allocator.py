"""The KV block pool: which of the engine's `num_kv_blocks` cache blocks each request holds, and which
full blocks are kept as an automatic prefix cache (vLLM's design: chained block hashes, reference
counts, and an LRU list of cached blocks nobody holds, evicted only when their memory is needed)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

# A block's name: SHA-256 of its parent's name and its token ids. Equal names mean equal token ids at
# equal positions after an equal prefix, i.e. equal K/V (the model and dtype are fixed per server).
BlockHash = bytes

# The parent of a sequence's first block; versioned so a change of scheme cannot match old names.
_ROOT_HASH: BlockHash = hashlib.sha256(b"orca-serve prefix cache v1").digest()


class NoFreeBlocksError(RuntimeError):
    pass


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The name of a full block holding `token_ids` after the block named `parent` (None: the first)."""
    h = hashlib.sha256(parent if parent is not None else _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockAllocator:
    """Reference-counted blocks over ids 0..num_blocks-1, with an optional prefix cache.

    A block is free (no holder, no hash), held (reference count > 0: it is in that many block
    tables), or cached and evictable (no holder, but it has a hash and its K/V stay valid). New blocks
    come from the free list first and only then from the least recently used evictable block, whose
    hash is dropped. `num_free` counts both kinds of unheld block: a cached block nobody holds is as
    available as a free one.

    Free blocks go to the back of the queue and are taken from the front, so a block is reused as
    late as possible (stale K/V from a finished request is not read back by a scheduling bug soon).
    All operations are O(1) per block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        # Unheld blocks with a hash, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # A double free or a free of a block never handed out would corrupt another request's cache
        # silently; counting holders per block makes it an immediate error instead.
        self._refs = array("i", bytes(4 * num_blocks))
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> block, held or evictable
        self.num_evictions = 0

    # ---- counts -----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no request holds (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a reusable prefix (held or evictable)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash[block]

    # ---- the prefix cache -------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (nothing is taken)."""
        blocks: list[int] = []
        if not self.enable_caching:
            return blocks
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unheld(self, blocks: Iterable[int]) -> int:
        """How many of these blocks nobody holds: taking them uses up that many of `num_free`."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks: Iterable[int]) -> None:
        """Add a holder to each cached block (a request starts from a cached prefix)."""
        for b in blocks:
            if self._hash[b] is None:
                raise ValueError(f"KV block {b} is not cached; only cached blocks are shared")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Name a held, full block whose K/V are computed, so later requests can reuse it. A block whose
        content is already cached under another id stays private (block tables never change under a
        running request to dedupe it); a block that already has a name keeps it."""
        if not self.enable_caching or self._hash[block] is not None or block_hash in self._cached:
            return
        if self._refs[block] == 0:
            raise ValueError(f"KV block {block} is cached but not in use")
        self._hash[block] = block_hash
        self._cached[block_hash] = block

    def forget_cached(self) -> None:
        """The K/V of every block are gone (the engine's workers restarted): nothing is cached any
        more; unheld cached blocks become free ones."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()

    # ---- taking and returning blocks --------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash[b]]  # type: ignore[arg-type]
                self._hash[b] = None
                self.num_evictions += 1
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def append_blocks(self, block_table: list[int], n: int) -> None:
        """Grow a request's block table by n blocks (all or none)."""
        block_table.extend(self.allocate(n))

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` to hold num_tokens tokens. False (and nothing taken) if too few are free."""
        missing = blocks_for_tokens(num_tokens, self.block_size) - len(block_table)
        if missing <= 0:
            return True
        if missing > self.num_free:
            return False
        self.append_blocks(block_table, missing)
        return True

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder from each block. Pass a request's table last block first: among blocks freed
        together, the first freed is evicted first, and a sequence's tail is the least shared part."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"KV block {b} freed but not in use")
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if self._hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)
