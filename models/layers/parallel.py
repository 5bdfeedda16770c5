"""Tensor-parallel context: which shard this process holds and how shards talk to each other.

With size 1 (the default) every collective is a no-op and nothing touches torch.distributed, so the
same layers run unchanged in a single process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (only used when size > 1)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank/size {self.rank}/{self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPContext()


def balanced_shard(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `total` items are split into `parts` contiguous runs whose
    sizes differ by at most one (earlier parts take the remainder)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class PPContext:
    """Pipeline-parallel stage: which contiguous range of decoder layers this process holds.

    Stage 0 also holds the token embedding, the last stage the final norm and the LM head; with size 1
    (the default) one stage holds everything.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad pipeline-parallel rank/size {self.rank}/{self.size}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """Layers [start, end) of this stage: contiguous, sizes differ by at most one (earlier stages
        take the remainder, since the last stage also runs the LM head)."""
        if num_layers < self.size:
            raise ValueError(f"{num_layers} layers cannot be split into {self.size} pipeline stages")
        start, count = balanced_shard(num_layers, self.size, self.rank)
        return range(start, start + count)


SINGLE_STAGE = PPContext()
