"""Where a decoder layer's small ops run as the fused Triton kernels of triton_fused.py: on CUDA
tensors with Triton installed (the module, which imports Triton, is imported only then)."""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch


@cache
def triton_imports() -> bool:
    """triton is installed and imports (a broken install, say built for another torch, does not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """models.layers.triton_fused where its kernels take `x`'s op, else None (torch's ops or the CPU
    kernels run it)."""
    if not x.is_cuda or not triton_imports():
        return None
    from models.layers import triton_fused

    return triton_fused if triton_fused.runs_on(x) else None
