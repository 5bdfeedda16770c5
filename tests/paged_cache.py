"""A paged KV cache and flat steps over it, built by hand (no engine): the models' and attention
backends' tests drive forwards with it (`from paged_cache import PagedCacheHarness`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.layers.kv_format import kv_format
from models.layers.metadata import AttentionMetadata, KVCache

BLOCK_SIZE = 4  # small, so sequences cross many block boundaries
NUM_BLOCKS = 64


@dataclass
class PagedBatch:
    """A step's flat inputs for sequences that each already have `cached[i]` tokens in the cache."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


class PagedCacheHarness:
    """Owns a paged KV cache and per-sequence block tables drawn from a shuffled free list, so
    sequences' blocks are interleaved and non-contiguous like under a real allocator.

    `model` gives the cache shape: anything with num_layers, num_kv_heads and head_dim."""

    def __init__(
        self,
        model,
        num_seqs: int,
        seed: int = 0,
        *,
        block_size: int = BLOCK_SIZE,
        num_blocks: int = NUM_BLOCKS,
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """`kv_cache_dtype` (a --kv-cache-dtype name) overrides `dtype` with that format's storage."""
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        row = model.head_dim
        if kv_cache_dtype is not None:
            fmt = kv_format(kv_cache_dtype)
            dtype, row = fmt.storage, fmt.row_width(model.head_dim)
        shape = (num_blocks, block_size, model.num_kv_heads, row)
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(model.num_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.block_tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.seq_lens = [0] * num_seqs

    def step(self, tokens_per_seq: list[list[int]]) -> PagedBatch:
        bs = self.block_size
        ids, positions, slots, q_lens = [], [], [], []
        for i, toks in enumerate(tokens_per_seq):
            start = self.seq_lens[i]
            for pos in range(start, start + len(toks)):
                if pos // bs >= len(self.block_tables[i]):
                    self.block_tables[i].append(self.free.pop())
                slots.append(self.block_tables[i][pos // bs] * bs + pos % bs)
                positions.append(pos)
            ids += toks
            q_lens.append(len(toks))
            self.seq_lens[i] = start + len(toks)
        width = max(len(t) for t in self.block_tables)
        tables = [t + [0] * (width - len(t)) for t in self.block_tables]
        cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
        cu_k = torch.tensor([0] + self.seq_lens).cumsum(0).int()
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=cu_q,
            seq_start_loc=cu_k,
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_lens_cpu=q_lens,
            seq_lens_cpu=list(self.seq_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(self.seq_lens),
            block_size=bs,
        )
        return PagedBatch(torch.tensor(ids), torch.tensor(positions), md)


def step_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """A step's metadata over given block tables: sequence i runs query_lens[i] new tokens, the last of
    its seq_lens[i] positions (slots unused: the tests calling this write no cache)."""
    q_starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    k_starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        query_start_loc=q_starts,
        seq_start_loc=k_starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def reference_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D] float32
    """Attention written from its definition, independent of every backend: each sequence's whole
    history gathered from its blocks, and a mask over absolute positions (query at p sees key k iff
    k <= p and, with a window W, k > p - W: transformers' sliding-window convention)."""
    bs = k_cache.shape[1]
    h_kv, d = k_cache.shape[-2:]
    outs, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
        blocks = md.block_tables[i, : -(-seq_len // bs)].long()
        k = k_cache[blocks].reshape(-1, h_kv, d)[:seq_len].float().transpose(0, 1)
        v = v_cache[blocks].reshape(-1, h_kv, d)[:seq_len].float().transpose(0, 1)
        pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
        key = torch.arange(seq_len).unsqueeze(0)  # [1, seq_len]
        mask = key <= pos
        if window is not None:
            mask &= key > pos - window
        qi = q[start : start + q_len].float().transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
        start += q_len
    return torch.cat(outs)
