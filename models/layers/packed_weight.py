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

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP_SIZE = 32  # columns of W sharing one scale and zero (GGUF's block size)


@dataclass
class PackedWeight:
    """W[n, k] = scales[n, k // 32] * codes[n, k] + zeros[n, k // 32].

    Checked once here, so the kernel (models/kernels/cpu.py), which trusts its pointers, can take a
    PackedWeight on every call without looking at it again."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // 32] float32
    zeros: torch.Tensor  # [N, K // 32] float32

    def __post_init__(self) -> None:
        c = self.codes
        if c.dim() != 2 or c.dtype != torch.int8 or not c.is_contiguous() or c.shape[1] % GROUP_SIZE:
            raise ValueError(f"codes: expected contiguous int8 [N, K] with K a multiple of {GROUP_SIZE}")
        groups = (c.shape[0], c.shape[1] // GROUP_SIZE)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != groups:
                raise ValueError(
                    f"{name}: expected contiguous float32 {groups}, got {t.dtype} {tuple(t.shape)}"
                )
        if not c.device.type == self.scales.device.type == self.zeros.device.type == "cpu":
            raise ValueError("a packed weight lives on the CPU")

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
    """(codes, exact) of one candidate format: codes [N, G, 32] float, exact [N, G] bool per group.

    In-place ops and a reciprocal instead of a division: this runs over every weight of the model at
    load. The codes only need to round to the right integers, and the exactness check catches any
    that do not. A group with scale 0 is constant and gets codes 0 (its zero, or 0, is the value)."""
    s = scale.unsqueeze(-1)
    z = zero.unsqueeze(-1)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    codes = groups - z
    codes.mul_(inv).round_().clamp_(qmin, qmax)
    recon = codes * s
    recon.add_(z)  # multiply, then add: two roundings, as gguf-py dequantizes
    return codes, recon.eq_(groups).all(dim=-1)


# Candidate (scale, zero, qmin, qmax) per group of each block format, from the groups' min and max.
Candidate = tuple[torch.Tensor, torch.Tensor, int, int]


def _extreme(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude in each group."""
    return torch.where(hi.abs() > lo.abs(), hi, lo)


FORMATS: dict[str, Callable[[torch.Tensor, torch.Tensor], Candidate]] = {
    "Q4_1": lambda lo, hi: (_half((hi - lo) / 15), lo, 0, 15),
    "Q8_0": lambda lo, hi: (_half(_extreme(lo, hi).abs() / 127), torch.zeros_like(lo), -127, 127),
    "Q4_0": lambda lo, hi: (_half(_extreme(lo, hi) / -8), torch.zeros_like(lo), -8, 7),
}


def _pack_groups(groups: torch.Tensor, order: list[str]) -> tuple[PackedWeight, str] | None:
    """Try the formats in `order` group by group; (packed, first format used) if every group fits."""
    n, g, _ = groups.shape
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    codes = scales = zeros = done = None
    for name in order:
        scale, zero, qmin, qmax = FORMATS[name](lo, hi)
        c, exact = _try_format(groups, scale, zero, qmin, qmax)
        exact &= _half(zero) == zero  # Q4_1 stores its minimum as float16 (the others' zero is 0)
        if done is None and bool(exact.all()):  # the usual case: one format for the whole tensor
            return PackedWeight(c.to(torch.int8).view(n, -1), scale, zero), name
        if done is None:
            codes = torch.zeros_like(groups, dtype=torch.int8)
            scales, zeros = torch.zeros_like(scale), torch.zeros_like(scale)
            done = torch.zeros_like(exact)
        take = exact & ~done
        codes[take] = c[take].to(torch.int8)
        scales[take] = scale[take]
        zeros[take] = zero[take]
        done |= take
        if bool(done.all()):
            return PackedWeight(codes.view(n, -1), scales, zeros), order[0]
    return None


def pack_exact(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form of a 2-D float32 weight if every group of it is exactly representable."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP_SIZE:
        return None
    n, k = weight.shape
    groups = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    # The first row decides cheaply whether to look further (a float checkpoint fails there) and
    # which format to try first on the rest (an embedding is Q8_0 where the projections are Q4_1).
    # NaN and infinities need no check of their own: they never reconstruct exactly.
    first = _pack_groups(groups[:1], list(FORMATS))
    if first is None:
        return None
    if n == 1:
        return first[0]
    packed = _pack_groups(groups, [first[1], *(name for name in FORMATS if name != first[1])])
    return None if packed is None else packed[0]
