"""Activations. Gated MLPs keep gate and up in one tensor (one fused matmul), split here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.layers.gpu_fused import fused_ops


def _fused_gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor | None:
    """act(gate) * up by the fused GPU kernel (triton_fused.py) where it takes x, else None."""
    fused = fused_ops(x)
    if fused is None or not x.is_contiguous():
        return None
    out = fused.act_and_mul(x.view(-1, x.shape[-1]), gelu_tanh=gelu_tanh)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> [..., d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.fits_rowwise(x, x.shape[-1] // 2):
            return cpu_kernels.silu_and_mul(x)
        out = _fused_gated(x, gelu_tanh=False)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> [..., d] = gelu_tanh(gate) * up (Gemma's MLP). On a CPU in float32
    the native kernel, which the fused decode call runs too (the two paths stay bit-identical)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.fits_rowwise(x, x.shape[-1] // 2):
            return cpu_kernels.gelu_tanh_and_mul(x)
        out = _fused_gated(x, gelu_tanh=True)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_GELU_APPROXIMATION = {
    "gelu_new": "tanh",  # GPT-2's "new" GELU is the tanh approximation
    "gelu_pytorch_tanh": "tanh",
    "gelu_fast": "tanh",
    "gelu": "none",
}


def get_gelu(name: str) -> nn.Module:
    """The GELU variant a GPT-2-style config names (`activation_function`)."""
    if name not in _GELU_APPROXIMATION:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_GELU_APPROXIMATION)}")
    return nn.GELU(approximate=_GELU_APPROXIMATION[name])
