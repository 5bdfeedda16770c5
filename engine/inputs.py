"""One step's flat model inputs and attention metadata, built from the scheduler's batch.

One pass in Python over the batch collects plain lists, then each tensor is created once; on CUDA they go
through pinned memory with non-blocking copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.contract import ScheduledSequence
from engine.kv_cache import slot_mapping as compute_slot_mapping
from models.layers.metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # indices into the batch of the entries that sample a token
    logits_indices: torch.Tensor  # [S] int64: flat index of each sampling entry's last token


@dataclass(frozen=True)
class InputLimits:
    """What a batch must fit (checked only under the debug switch: see check_batch)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def build_step_inputs(
    batch: Sequence[ScheduledSequence], block_size: int, device: torch.device
) -> StepInputs:
    """Turn `batch` into tensors. The batch is trusted: every request was validated at admission and
    the scheduler builds block tables from its own allocator (check_batch verifies it in debug runs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[Sequence[int]] = []
    sample_rows: list[int] = []
    last_token_index: list[int] = []

    for i, seq in enumerate(batch):
        n = len(seq.token_ids)
        start = seq.start_position
        ctx = start + n
        input_ids.extend(seq.token_ids)
        positions.extend(range(start, ctx))
        query_lens.append(n)
        seq_lens.append(ctx)
        # Only the blocks that hold this context: a reserving scheduler may hand over more.
        tables.append(seq.block_table[: -(-ctx // block_size)])
        if seq.sample:
            sample_rows.append(i)
            last_token_index.append(len(input_ids) - 1)

    max_blocks = max(len(t) for t in tables)
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]

    input_ids_cpu = torch.tensor(input_ids, dtype=torch.int64)  # [T]
    block_tables_cpu = torch.tensor(padded, dtype=torch.int32)  # [B, max_blocks]
    positions_cpu = torch.tensor(positions, dtype=torch.int64)  # [T]
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)  # [B]
    seq_index = torch.repeat_interleave(torch.arange(len(batch)), query_lens_t)  # [T]
    slots_cpu = compute_slot_mapping(block_tables_cpu, seq_index, positions_cpu, block_size)  # [T]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)  # [B]
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)  # [B+1]
    query_start_loc[1:] = torch.cumsum(query_lens_t, 0)
    seq_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)  # [B+1]
    seq_start_loc[1:] = torch.cumsum(seq_lens_t, 0)

    metadata = AttentionMetadata(
        slot_mapping=_to_device(slots_cpu, device),
        query_start_loc=_to_device(query_start_loc, device),
        seq_start_loc=_to_device(seq_start_loc, device),
        seq_lens=_to_device(seq_lens_t, device),
        block_tables=_to_device(block_tables_cpu, device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=_to_device(input_ids_cpu, device),
        positions=_to_device(positions_cpu, device),
        attn_metadata=metadata,
        sample_rows=sample_rows,
        logits_indices=_to_device(torch.tensor(last_token_index, dtype=torch.int64), device),
    )


def check_batch(batch: Sequence[ScheduledSequence], limits: InputLimits) -> None:
    """Raise ValueError for a batch the engine must not run (it would read or write the wrong KV slots,
    or index past the embedding). Only under the debug switch (ORCA_DEBUG_CHECKS=1): in serving, the
    loop validates requests once at admission and the scheduler's block tables are right by
    construction, so paying for this every step would check the same facts again."""
    seen: set[str] = set()
    for seq in batch:
        rid, n, start = seq.request_id, len(seq.token_ids), seq.start_position
        ctx = start + n
        if n == 0:
            raise ValueError(f"request {rid!r}: no tokens to run")
        if rid in seen:
            raise ValueError(f"request {rid!r} appears twice in one batch")
        seen.add(rid)
        if start < 0:
            raise ValueError(f"request {rid!r}: negative start_position {start}")
        if ctx > limits.max_model_len:
            raise ValueError(f"request {rid!r}: {ctx} tokens exceed max_model_len {limits.max_model_len}")
        needed = -(-ctx // limits.block_size)
        if len(seq.block_table) < needed:
            raise ValueError(
                f"request {rid!r}: block table has {len(seq.block_table)} blocks, "
                f"{needed} needed for {ctx} tokens at block_size {limits.block_size}"
            )
        bad_token = next((t for t in seq.token_ids if not 0 <= t < limits.vocab_size), None)
        if bad_token is not None:
            raise ValueError(f"request {rid!r}: token id {bad_token} out of range [0, {limits.vocab_size})")
        bad_block = next((b for b in seq.block_table[:needed] if not 0 <= b < limits.num_kv_blocks), None)
        if bad_block is not None:
            raise ValueError(
                f"request {rid!r}: block id {bad_block} out of range [0, {limits.num_kv_blocks})"
            )
