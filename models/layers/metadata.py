"""Per-step attention metadata: built once per step by the engine, read (never kept) by the models."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and in the paged KV cache.

    The batch holds B sequences; sequence i contributes query_lens[i] tokens (its prompt, a prompt
    chunk or one decode token) and, after this step, has seq_lens[i] tokens of K/V history.
    """

    # --- device tensors ---
    slot_mapping: torch.Tensor  # [T] int64: KV slot of each new token (block_id * block_size + offset)
    query_start_loc: torch.Tensor  # [B+1] int32: cu_seqlens_q
    seq_start_loc: torch.Tensor  # [B+1] int32: cu_seqlens_k (over the full histories)
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    # --- host-side copies, so per-request loops never sync the device ---
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


# One layer's paged cache: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
# (the layout flash-attn's paged kernels read).
KVCache = tuple[torch.Tensor, torch.Tensor]
