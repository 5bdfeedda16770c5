"""Float32 weights that are exactly group-quantized, kept as int8 codes + per-group scale and zero.

A GGUF checkpoint is dequantized to float32 when it is converted (see gguf_convert.py), but its values
keep their structure: in every group of 32 columns each weight is exactly `s * q + z` (float32
multiply, then add), with s and z float16 values and q a small integer. `pack_exact` finds s, z and q
for the block formats the default model uses and keeps the weight packed only if the reconstruction is
bit-identical to the float32 tensor, so packing never changes a single weight:

    Q4_1  q in [0, 15],     z = the group's minimum,  s = (max - min) / 15  rounded to float16
    Q8_0  q in [-127, 127], z = 0,                    s = absmax / 127       rounded to float16
    Q4_0  q in [-8, 7],     z = 0,                    s = -extreme / 8       rounded to float16

Each group may match a different format. A tensor with any group that fits none stays float32
(ordinary float checkpoints: nothing matches, and the cost is one pass over the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kernels.cpu import GROUP_SIZE


@dataclass
class PackedWeight:
    """W[n, k] = scales[n, k // 32] * codes[n, k] + zeros[n, k // 32]."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // 32] float32
    zeros: torch.Tensor  # [N, K // 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        # Two roundings (multiply, then add), as the kernel and gguf-py do: not torch.addcmul.
        return (groups * self.scales.unsqueeze(-1) + self.zeros.unsqueeze(-1)).view(n, k)


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _try_format(
    groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, exact) of one candidate format: codes [N, G, 32], exact [N, G] bool per group."""
    s = scale.unsqueeze(-1)
    z = zero.unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.round((groups - z) / safe).clamp_(qmin, qmax)
    codes = torch.where(s == 0, torch.zeros_like(codes), codes)
    exact = (codes * s + z == groups).all(dim=-1)
    return codes, exact


def pack_exact(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form of a 2-D float32 weight if every group of it is exactly representable."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP_SIZE:
        return None
    n, k = weight.shape
    if n > 1 and pack_exact(weight[:1]) is None:
        return None  # a float checkpoint fails on its first row: skip the full pass
    groups = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if not torch.isfinite(groups).all():
        return None
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    extreme = torch.where(hi.abs() > lo.abs(), hi, lo)
    zeros_ = torch.zeros_like(lo)
    candidates = (
        (_half((hi - lo) / 15), lo, 0, 15),  # Q4_1
        (_half(extreme.abs() / 127), zeros_, -127, 127),  # Q8_0
        (_half(extreme / -8), zeros_, -8, 7),  # Q4_0
    )
    codes = torch.zeros_like(groups, dtype=torch.int8)
    scales = torch.zeros_like(lo)
    zeros = torch.zeros_like(lo)
    done = torch.zeros_like(lo, dtype=torch.bool)
    for scale, zero, qmin, qmax in candidates:
        c, exact = _try_format(groups, scale, zero, qmin, qmax)
        take = exact & (_half(zero) == zero) & ~done  # Q4_1 stores its minimum as float16
        if take.any():
            codes[take] = c[take].to(torch.int8)
            scales[take] = scale[take]
            zeros[take] = zero[take]
            done |= take
        if bool(done.all()):
            return PackedWeight(codes.view(n, k), scales, zeros)
    return None
