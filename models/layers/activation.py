"""Activations. Gated MLPs keep gate and up in one tensor (one fused matmul), split here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.layers.gpu_fused import fused_ops


class _GatedAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> [..., d] = act(gate) * up. On a CPU in float32 the native kernel,
    which the fused decode call runs too (the two paths stay bit-identical); on a GPU the fused Triton
    kernel (triton_fused.py); else torch's ops."""

    gelu_tanh: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.fits_rowwise(x, x.shape[-1] // 2):
            kernel = cpu_kernels.gelu_tanh_and_mul if self.gelu_tanh else cpu_kernels.silu_and_mul
            return kernel(x)
        fused = fused_ops(x)
        if fused is not None and x.is_contiguous():
            out = fused.act_and_mul(x.view(-1, x.shape[-1]), gelu_tanh=self.gelu_tanh)
            return out.view(*x.shape[:-1], x.shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu_tanh else F.silu(gate)
        return act * up


class SiluAndMul(_GatedAndMul):
    """silu(gate) * up (Llama's MLP)."""

    gelu_tanh = False


class GeluTanhAndMul(_GatedAndMul):
    """gelu_tanh(gate) * up (Gemma's MLP)."""

    gelu_tanh = True


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
