"""torch.distributed plumbing for tensor and pipeline parallelism: who is who, the process groups, and
the compact control message that carries one step's batch to every rank.

Ranks are laid out stage-major: rank = stage * tp_size + tp_rank, so the ranks of one pipeline stage
are neighbours (one machine's GPUs, in the usual torchrun layout) and rank 0, the driver that runs the
scheduler and samples, is tensor rank 0 of the first stage.

Three kinds of traffic, on separate groups so that each gets the right timeout:
- control (gloo, CPU tensors): the step message. A worker waits on it while the server is idle, for as
  long as it takes, so its timeout is very long; a driver that dies closes the sockets and the wait
  fails at once.
- data (NCCL on CUDA, gloo on CPU): hidden states between stages, logits to the driver. These only
  happen inside a step, so the configured timeout turns a peer that hangs into an error.
- tensor-parallel collectives of each stage (the all-reduces and all-gathers of the layers).
Start-up agreement (the KV block count) uses gloo with the normal timeout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.contract import POOLING_METHODS, FatalRunnerError, ScheduledSequence

# A worker may wait this long for the next step of an idle server.
CONTROL_TIMEOUT = timedelta(days=365)

# Step message header: these int64 values in this order, then zeros up to HEADER_LEN (StepMessage
# reads them by name).
HEADER_FIELDS = ("op", "num_seqs", "num_tokens", "max_blocks", "num_logit_rows", "payload_len")
HEADER_LEN = 8
_PAYLOAD_LEN = HEADER_FIELDS.index("payload_len")
OP_STEP = 1
OP_SHUTDOWN = 2


class WorkerDiedError(FatalRunnerError):
    """A rank of the process group died or stopped answering. The group cannot be repaired: the
    executor is down until restart() replaces the whole group (FatalRunnerError)."""


@dataclass(frozen=True)
class Topology:
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp_size} pp={self.pp_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp_size

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, t) for t in range(self.tp_size)]


@dataclass
class RankGroups:
    """This rank's place in the topology and the groups it talks over."""

    rank: int
    topology: Topology
    device: torch.device
    control: dist.ProcessGroup  # gloo, every rank, very long timeout: step messages between stages
    cpu: dist.ProcessGroup | None  # gloo, every rank, normal timeout: start-up agreement (None: default)
    data: dist.ProcessGroup | None  # hidden states and logits: the default group (device backend)
    tp: dist.ProcessGroup | None  # device backend, this stage's ranks: the layers' collectives
    stage0_control: dist.ProcessGroup | None  # gloo, stage 0's ranks: the driver's step broadcast

    @property
    def stage(self) -> int:
        return self.topology.stage_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.topology.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """The same tensor rank in the previous stage (it sends this rank its stage's output)."""
        return self.topology.rank_of(self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.topology.rank_of(self.stage + 1, self.tp_rank)

    @property
    def last_stage_head(self) -> int:
        """The rank that sends the logits to the driver."""
        return self.topology.rank_of(self.topology.pp_size - 1, 0)


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets these for every process it starts."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_groups(
    rank: int,
    topology: Topology,
    init_method: str,
    device: torch.device,
    timeout_s: float,
) -> RankGroups:
    """Join the rendezvous and create every group (each rank creates all of them, in the same order,
    as torch.distributed requires, and keeps its own)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    world = topology.world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(list(range(world)), backend="gloo", timeout=CONTROL_TIMEOUT)
    # On CPU the default group is gloo already; NCCL cannot reduce CPU tensors.
    cpu = dist.new_group(list(range(world)), backend="gloo", timeout=timeout) if backend != "gloo" else None
    stage = topology.stage_of(rank)
    my_tp: dist.ProcessGroup | None = None
    stage0_control: dist.ProcessGroup | None = None
    if topology.tp_size > 1:
        for s in range(topology.pp_size):
            group = dist.new_group(topology.stage_ranks(s), backend=backend, timeout=timeout)
            if s == stage:
                my_tp = group
        stage0_control = dist.new_group(topology.stage_ranks(0), backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroups(
        rank=rank,
        topology=topology,
        device=device,
        control=control,
        cpu=cpu,
        data=None,
        tp=my_tp,
        stage0_control=stage0_control if stage == 0 else None,
    )


def agree_on_min(value: int, group: dist.ProcessGroup | None) -> int:
    """The smallest value any rank holds (e.g. KV blocks: every rank must use the same block count)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# ---- the step message --------------------------------------------------------------------------------


class _HeaderField:
    """A StepMessage property: the int at its name's place in HEADER_FIELDS."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.index = HEADER_FIELDS.index(name)

    def __get__(self, msg: StepMessage, owner: type | None = None) -> int:
        return int(msg.header[self.index])


@dataclass
class StepMessage:
    """One step's batch as two int64 CPU tensors: what every rank needs to build the same flat inputs
    and attention metadata, and nothing else (no request ids, no sampling parameters: the driver samples).

    payload = token_ids [T] | query_lens [B] | start_positions [B] | flags [B] |
              block tables [B * max_blocks] (row-major, padded with 0)
    flags = sample (bit 0) | pooling (bits 1-2: 0 none, else 1 + its index in POOLING_METHODS) |
            num_prompt_scored << 3
    """

    header: torch.Tensor  # [HEADER_LEN] int64
    payload: torch.Tensor  # [payload_len] int64

    op = _HeaderField()  # OP_STEP or OP_SHUTDOWN
    num_seqs = _HeaderField()
    num_tokens = _HeaderField()
    max_blocks = _HeaderField()  # of a block table (the rows are padded to it)
    num_logit_rows = _HeaderField()  # the rows of logits the last stage sends back: samples, scored prompts
    payload_len = _HeaderField()

    @property
    def nbytes(self) -> int:
        return (self.header.numel() + self.payload.numel()) * 8


def _header(
    op: int, num_seqs: int, num_tokens: int, max_blocks: int, num_logit_rows: int, payload_len: int
) -> torch.Tensor:
    """The values in HEADER_FIELDS' order."""
    values = [op, num_seqs, num_tokens, max_blocks, num_logit_rows, payload_len]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def shutdown_message() -> StepMessage:
    return StepMessage(_header(OP_SHUTDOWN, 0, 0, 0, 0, 0), torch.empty(0, dtype=torch.int64))


def encode_batch(batch: Sequence[ScheduledSequence]) -> StepMessage:
    tokens: list[int] = []
    query_lens: list[int] = []
    starts: list[int] = []
    flags: list[int] = []
    max_blocks = max(len(s.block_table) for s in batch)
    tables: list[int] = []
    rows = 0
    for seq in batch:
        tokens.extend(seq.token_ids)
        query_lens.append(len(seq.token_ids))
        starts.append(seq.start_position)
        flags.append((1 if seq.sample else 0) | _pooling_code(seq) << 1 | seq.num_prompt_scored << 3)
        rows += int(seq.sample) + seq.num_prompt_scored
        tables.extend(seq.block_table)
        tables.extend([0] * (max_blocks - len(seq.block_table)))
    payload = torch.tensor(tokens + query_lens + starts + flags + tables, dtype=torch.int64)
    header = _header(OP_STEP, len(batch), len(tokens), max_blocks, rows, payload.numel())
    return StepMessage(header, payload)


def _pooling_code(seq: ScheduledSequence) -> int:
    return 0 if seq.pooling is None else 1 + POOLING_METHODS.index(seq.pooling)


def decode_batch(msg: StepMessage) -> list[ScheduledSequence]:
    """The batch as the driver saw it, minus what only the driver needs (ids are "0", "1", ...)."""
    b, t, m = msg.num_seqs, msg.num_tokens, msg.max_blocks
    values: list[int] = msg.payload.tolist()
    tokens = values[:t]
    query_lens = values[t : t + b]
    starts = values[t + b : t + 2 * b]
    flags = values[t + 2 * b : t + 3 * b]
    tables = values[t + 3 * b :]
    out: list[ScheduledSequence] = []
    offset = 0
    for i in range(b):
        n = query_lens[i]
        out.append(
            ScheduledSequence(
                request_id=str(i),
                token_ids=tokens[offset : offset + n],
                start_position=starts[i],
                block_table=tables[i * m : (i + 1) * m],
                sample=bool(flags[i] & 1),
                num_prompt_scored=flags[i] >> 3,
                pooling=POOLING_METHODS[(flags[i] >> 1 & 3) - 1] if flags[i] >> 1 & 3 else None,
            )
        )
        offset += n
    return out


def send_message(msg: StepMessage, dst: int, group: dist.ProcessGroup) -> None:
    dist.send(msg.header, dst, group=group)
    if msg.payload.numel():
        dist.send(msg.payload, dst, group=group)


def recv_message(src: int, group: dist.ProcessGroup) -> StepMessage:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src, group=group)
    payload = torch.empty(int(header[_PAYLOAD_LEN]), dtype=torch.int64)
    if payload.numel():
        dist.recv(payload, src, group=group)
    return StepMessage(header, payload)


def broadcast_message(msg: StepMessage | None, src: int, group: dist.ProcessGroup) -> StepMessage:
    """From src (which passes msg) to every rank of group (which pass None)."""
    header = msg.header if msg is not None else torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    payload = msg.payload if msg is not None else torch.empty(int(header[_PAYLOAD_LEN]), dtype=torch.int64)
    if payload.numel():
        dist.broadcast(payload, src, group=group)
    return StepMessage(header, payload)
