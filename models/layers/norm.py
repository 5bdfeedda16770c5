"""Normalisation layers: torch's fused ops, or the native CPU kernel (models/kernels/cpu.py) in float32
on a CPU, where per-op dispatch is what small-batch decode spends its time on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.layers.gpu_fused import fused_ops
from models.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    # Whether the weight multiplies the normalised value in float32 before the cast to the model dtype
    # (Gemma) rather than after it (Llama, as transformers does).
    scale_in_float32 = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual). The fused form
        may update `residual` in place, so the caller must use the returned stream from then on."""
        if cpu_kernels.fits_rowwise(x, x.shape[-1]) and (
            residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)
        ):
            normed = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, residual)
        fused = fused_ops(x)
        if fused is not None and _rows_fit(x, residual):
            h = x.shape[-1]
            normed = fused.rms_norm(
                x.view(-1, h), self.weight, self.eps,
                None if residual is None else residual.view(-1, h), self.scale_in_float32,
            ).view(x.shape)  # fmt: skip
            return normed if residual is None else (normed, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def norm_then(
        self, x: torch.Tensor, then: RMSNorm, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """then(self(x), residual): (then's output, the updated stream), as `forward` with a residual
        returns them (Gemma 3's post-attention norm before its pre-feedforward one). One launch where
        the fused GPU kernels run (the stream updated in place); else the two norms."""
        fused = fused_ops(x)
        if fused is not None and _rows_fit(x, residual) and self.pairs_with(then):
            h = x.shape[-1]
            normed = fused.rms_norm(
                x.view(-1, h), then.weight, then.eps, residual.view(-1, h), then.scale_in_float32, self.weight
            ).view(x.shape)
            return normed, residual
        return then(self(x), residual=residual)  # type: ignore[return-value]

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) (Gemma 3's post-feedforward norm and the residual add after it): one
        launch where the fused GPU kernels run, which updates `residual` in place."""
        fused = fused_ops(x)
        if fused is not None and _rows_fit(x, residual):
            h = x.shape[-1]
            fused.add_rms_normed(
                x.view(-1, h), self.weight, self.eps, residual.view(-1, h), self.scale_in_float32
            )
            return residual
        return residual + self(x)

    def pairs_with(self, other: RMSNorm) -> bool:
        """Whether one fused launch can run this norm and `other` (the same epsilon and rounding)."""
        return self.eps == other.eps and self.scale_in_float32 == other.scale_in_float32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Like transformers: normalise in float32, cast back, then scale in the model dtype.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return normed * self.weight


def _rows_fit(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """x (and the residual stream) as rows the fused kernel reads: contiguous, of one dtype."""
    return x.is_contiguous() and (
        residual is None
        or (residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape)
    )


def qk_rms_norm(
    qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """Per-head RMSNorm of the q and k heads of a fused qkv projection [T, (Hq + 2 Hkv) * D] (Qwen3's
    q_norm / k_norm, before rotary); v passes. In place in float32 on a CPU (one native call, the
    same one the fused decode layers make), else a new tensor from torch's ops."""
    d = q_norm.weight.shape[0]
    if cpu_kernels.fits_rowwise(qkv, d) and qkv.dim() == 2 and q_norm.eps == k_norm.eps:
        cpu_kernels.qk_norm(qkv, q_norm.weight, k_norm.weight, q_norm.eps, num_heads, num_kv_heads)
        return qkv
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q_norm(q.reshape(t, num_heads, d)).reshape(t, -1)
    k = k_norm(k.reshape(t, num_kv_heads, d)).reshape(t, -1)
    return torch.cat([q, k, v], dim=-1)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
