"""The gated MLP of the Llama-style families: gate and up in one column-parallel matmul, the gated
activation, down in a row-parallel one (an all-reduce under tensor parallelism)."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from models.layers.parallel import TPContext


class GatedMLP(nn.Module):
    """down(act(gate) * up) over [T, hidden]; `act` splits the fused [T, 2 * inter] (SiluAndMul,
    GeluTanhAndMul). The parameter names (gate_up_proj, down_proj) are the ones the families' weight
    names and the native decode layout read."""

    def __init__(
        self, hidden: int, inter: int, bias: bool, act: nn.Module, dtype: torch.dtype, tp: TPContext
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, dtype, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, dtype, tp)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
