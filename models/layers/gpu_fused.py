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


@cache
def _fused_module() -> ModuleType | None:
    """models.layers.triton_fused, imported once, or None without Triton."""
    if not triton_imports():
        return None
    from models.layers import triton_fused

    return triton_fused


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """models.layers.triton_fused where its kernels take `x`'s op, else None (torch's ops or the CPU
    kernels run it). Called by every layer's norms, activation and rotary: a CPU tensor returns at once."""
    if not x.is_cuda:
        return None
    module = _fused_module()
    return module if module is not None and module.runs_on(x) else None
