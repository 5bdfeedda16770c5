"""One step's flat model inputs and attention metadata, built from the scheduler's batch.

One pass in Python over the batch collects plain lists, then each host tensor is created once
(build_host_inputs); on CUDA they reach the device in one non-blocking copy from pinned memory
(HostStepInputs.to), or, for a CUDA-graph decode step, into the graph's own buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from engine.contract import Pooling, ScheduledSequence
from engine.kv_cache import slots_of
from models.layers.metadata import AttentionMetadata

# Staged arrays start on 16-byte boundaries: 4 int32 words.
_ALIGN_WORDS = 4


@dataclass(frozen=True)
class PoolSpan:
    """An embedding entry's tokens in the step's flat tokens: what engine.pooling pools."""

    entry: int  # index into the batch
    first: int  # flat index of its first token
    num_tokens: int
    pooling: Pooling


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # indices into the batch of the entries that sample a token
    # [R] int64: flat indices of the tokens whose logits are computed: for each entry in batch order,
    # its scored prompt positions (prompt logprobs), then its last token if it samples. R == S unless
    # an entry scores its prompt.
    logits_indices: torch.Tensor
    # Prompt logprobs: (batch index, first logits row, rows) per entry that scores; and the logits row
    # of each sampling entry (None when no entry scores: row i is sampling entry i).
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    sample_logit_rows: list[int] | None = None
    pools: list[PoolSpan] = field(default_factory=list)  # the embedding entries, in batch order

    @property
    def num_logit_rows(self) -> int:
        return int(self.logits_indices.numel())


@dataclass(frozen=True)
class InputLimits:
    """What a batch must fit (checked only under the debug switch: see check_batch)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class CarriedTokens:
    """Token ids that are on the device already (overlapped scheduling on an accelerator: what the step
    before sampled for the rows this one carries, engine.contract.DeviceCarry): written over the
    step's input ids once those are on the device, in the same stream, so behind that step."""

    flat_indices: list[int]  # [C] where in the step's flat tokens each one goes
    token_ids: torch.Tensor  # [C] int64 on the device

    def write(self, input_ids: torch.Tensor) -> None:
        dst = to_device(torch.tensor(self.flat_indices, dtype=torch.int64), input_ids.device)
        input_ids.index_copy_(0, dst, self.token_ids)


@dataclass
class HostStepInputs:
    """A step's inputs on the host (CPU tensors and their Python lists), before any device copy: what
    `to(device)` turns into StepInputs for an eager step, and what a CUDA-graph step copies into the
    graph's persistent buffers instead (engine/cuda_graphs.py)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens: list[int]
    seq_lens_list: list[int]
    sample_rows: list[int]  # indices into the batch of the entries that sample a token
    last_token_index: list[int]  # [R] the logits rows (see StepInputs.logits_indices)
    block_size: int
    scored: list[tuple[int, int, int]] = field(default_factory=list)  # see StepInputs
    sample_logit_rows: list[int] | None = None
    pools: list[PoolSpan] = field(default_factory=list)  # see StepInputs
    # Tokens that input_ids holds only a placeholder for (DeviceCarry).
    carried: CarriedTokens | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_logit_rows(self) -> int:
        return len(self.last_token_index)

    @property
    def is_decode_only(self) -> bool:
        """One token per sequence (decodes, and one-token prompts or chunks)."""
        return len(self.query_lens) == self.input_ids.shape[0]

    def to(self, device: torch.device) -> StepInputs:
        """Device tensors and attention metadata. On CUDA every integer input travels in one
        non-blocking copy from one pinned host tensor filled through numpy (`_staged_on`), so building
        a step never waits for the previous one and the step thread keeps the GIL while it builds."""
        # Prefix sums of a few ints: in Python (torch's cumsum and copies into a zeroed tensor cost ~10
        # us an op, a step at batch 1 is ~6 ms).
        query_start_loc = [0, *accumulate(self.query_lens)]  # [B+1]
        seq_start_loc = [0, *accumulate(self.seq_lens_list)]  # [B+1]
        if device.type == "cpu":
            ids, positions, slots = self.input_ids, self.positions, self.slot_mapping
            logits_indices = torch.tensor(self.last_token_index, dtype=torch.int64)
            qsl = torch.tensor(query_start_loc, dtype=torch.int32)
            ssl = torch.tensor(seq_start_loc, dtype=torch.int32)
            seq_lens, tables = self.seq_lens, self.block_tables
        else:
            ids, positions, slots, logits_indices, qsl, ssl, seq_lens, tables = self._staged_on(
                device, query_start_loc, seq_start_loc
            )
        if self.carried is not None:
            if device.type == "cpu":
                ids = ids.clone()  # the host tensor is the input itself on a CPU: keep it as built
            self.carried.write(ids)
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_start_loc=ssl,
            seq_lens=seq_lens,
            block_tables=tables,
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens_list,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens_list),
            block_size=self.block_size,
        )
        return StepInputs(
            input_ids=ids,
            positions=positions,
            attn_metadata=metadata,
            sample_rows=self.sample_rows,
            logits_indices=logits_indices,
            scored=self.scored,
            sample_logit_rows=self.sample_logit_rows,
            pools=self.pools,
        )

    def _staged_on(
        self, device: torch.device, query_start_loc: list[int], seq_start_loc: list[int]
    ) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_mapping, logits_indices, query_start_loc, seq_start_loc,
        seq_lens, block_tables) on `device`, as views of one device tensor that one non-blocking copy
        filled from one pinned host tensor. The host side is written through numpy, not with torch
        ops: under load the event loop's thread holds the GIL for long stretches, and each small torch
        op here handed it the GIL and waited to get it back (docs/benchmarks.md, "Where an
        iteration-level server's step goes"); numpy's assignments keep it."""
        t, r, b = self.input_ids.shape[0], len(self.last_token_index), self.num_seqs
        width = self.block_tables.shape[1]
        # int32 words, each array starting on a 16-byte boundary: Triton compiles a kernel once per
        # pointer alignment it sees (divisible by 16 or not), so offsets that moved with the batch's
        # sizes cost a fresh compile (~0.5 s) for each new combination while serving.
        sizes = [2 * t, 2 * t, 2 * t, 2 * r, b + 1, b + 1, b, b * width]
        starts = list(accumulate([0, *(_ALIGN_WORDS * -(-n // _ALIGN_WORDS) for n in sizes)]))
        host = torch.empty(starts[-1], dtype=torch.int32, pin_memory=device.type == "cuda")
        words = host.numpy()
        host_parts = [words[lo : lo + n] for lo, n in zip(starts, sizes, strict=False)]
        host_parts[0].view(np.int64)[:] = self.input_ids.numpy()
        host_parts[1].view(np.int64)[:] = self.positions.numpy()
        host_parts[2].view(np.int64)[:] = self.slot_mapping.numpy()
        host_parts[3].view(np.int64)[:] = self.last_token_index
        host_parts[4][:] = query_start_loc
        host_parts[5][:] = seq_start_loc
        host_parts[6][:] = self.seq_lens.numpy()
        host_parts[7][:] = self.block_tables.numpy().reshape(-1)
        dev = host.to(device, non_blocking=True)
        parts = [dev[lo : lo + n] for lo, n in zip(starts, sizes, strict=False)]
        return (
            *(p.view(torch.int64) for p in parts[:4]),
            parts[4],
            parts[5],
            parts[6],
            parts[7].view(b, width),
        )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: itself on the CPU; on CUDA a non-blocking copy from pinned memory
    (a copy from pageable memory would synchronise the stream)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def build_host_inputs(batch: Sequence[ScheduledSequence], block_size: int) -> HostStepInputs:
    """Turn `batch` into host tensors. The batch is trusted: every request was validated at admission
    and the scheduler builds block tables from its own allocator (check_batch verifies it in debug
    runs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []  # [T] the KV slot each token's K and V go to
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[Sequence[int]] = []
    sample_rows: list[int] = []
    last_token_index: list[int] = []  # the logits rows, in order (see StepInputs.logits_indices)
    scored: list[tuple[int, int, int]] = []
    sample_logit_rows: list[int] = []
    pools: list[PoolSpan] = []

    for i, seq in enumerate(batch):
        n = len(seq.token_ids)
        start = seq.start_position
        ctx = start + n
        first = len(input_ids)
        input_ids.extend(seq.token_ids)
        positions.extend(range(start, ctx))
        slots.extend(slots_of(seq.block_table, start, ctx, block_size))
        query_lens.append(n)
        seq_lens.append(ctx)
        # Only the blocks that hold this context: a reserving scheduler may hand over more.
        tables.append(seq.block_table[: -(-ctx // block_size)])
        if seq.num_prompt_scored:
            scored.append((i, len(last_token_index), seq.num_prompt_scored))
            last_token_index.extend(range(first, first + seq.num_prompt_scored))
        if seq.pooling is not None:
            pools.append(PoolSpan(i, first, n, seq.pooling))
        if seq.sample:
            sample_rows.append(i)
            sample_logit_rows.append(len(last_token_index))
            last_token_index.append(len(input_ids) - 1)

    max_blocks = max(len(t) for t in tables)
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]

    block_tables = torch.tensor(padded, dtype=torch.int32)  # [B, max_blocks]
    return HostStepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        # Built with the positions, a range per block: at batch 1 the torch form (an index tensor per
        # token, a gather, two divisions) was ~5 small ops, 0.17 ms of a ~6 ms step.
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        sample_rows=sample_rows,
        last_token_index=last_token_index,
        block_size=block_size,
        scored=scored,
        sample_logit_rows=sample_logit_rows if scored else None,
        pools=pools,
    )


def build_step_inputs(
    batch: Sequence[ScheduledSequence], block_size: int, device: torch.device
) -> StepInputs:
    """The step's inputs on `device` (build_host_inputs, then HostStepInputs.to)."""
    return build_host_inputs(batch, block_size).to(device)


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
