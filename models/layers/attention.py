"""The attention op of selective batching: write the step's K/V into the paged cache, then attend each
request's queries to that request's whole history (via one of the backends).

The model calls `AttentionStep.begin(backend, metadata)` once per forward, so backend planning (index
tensors, masks) is done once per step, not once per layer; every layer's `Attention` reads it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.layers.attention_backends import (
    AttentionBackend,
    BatchedDecodeBackend,
    FlashAttnBackend,
    SdpaBackend,
    TorchVarlenBackend,
    TritonBackend,
)
from models.layers.gpu_fused import fused_ops, triton_imports
from models.layers.kv_format import write_kv
from models.layers.metadata import AttentionMetadata, KVCache
from models.layers.norm import RMSNorm, qk_rms_norm
from models.layers.rotary import RotaryEmbedding
from models.options import ATTENTION_BACKEND_NAMES, ATTENTION_BACKENDS, CUDA_ONLY_ATTENTION_BACKENDS

BACKENDS: dict[str, type[AttentionBackend]] = {
    "sdpa": SdpaBackend,
    "cpu-decode": BatchedDecodeBackend,
    "torch-varlen": TorchVarlenBackend,
    "flash-attn": FlashAttnBackend,
    "triton": TritonBackend,
}
assert tuple(BACKENDS) == ATTENTION_BACKENDS  # the names the flags offer (models/options.py)


def torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available(device: torch.device | str) -> bool:
    """The triton backend can run here: compiled on CUDA, or on a CPU in Triton's interpreter.

    The interpreter is Triton's switch TRITON_INTERPRET=1, read when triton is first imported (the test
    suite sets it on machines without a GPU); it runs the kernels in numpy, far too slowly to serve.
    """
    on_cuda = torch.device(device).type == "cuda"
    if not (on_cuda or os.environ.get("TRITON_INTERPRET")) or not triton_imports():
        return False
    if on_cuda:
        return True
    from models.layers import triton_attention

    return triton_attention.INTERPRETED


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on this device in this environment."""
    names = ["sdpa", "cpu-decode"]
    if torch.device(device).type == "cuda":
        if torch_varlen_available():
            names.append("torch-varlen")
        if flash_attn_available():
            names.append("flash-attn")
    if triton_available(device):
        names.append("triton")
    return names


def auto_backend_name(device: torch.device | str) -> str:
    """The fastest backend available on this device.

    On CUDA: triton (reads the paged cache in place, and is the backend CUDA graphs capture: a decode
    step of a small model replays in a tenth of its eager time), else flash-attn if importable (its
    steps run eagerly: ask for it by name where its prefill matters more), else torch-varlen (gathers
    every history each layer), else sdpa. On a CPU: cpu-decode, which is sdpa for prompt chunks plus
    one batched call for all decode tokens (never triton: on a CPU it only runs in Triton's
    interpreter).
    """
    if torch.device(device).type != "cuda":
        return "cpu-decode"
    if triton_available(device):
        return "triton"
    if flash_attn_available():
        return "flash-attn"
    if torch_varlen_available():
        return "torch-varlen"
    return "sdpa"


def select_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Pick a backend by name, or the fastest one available with "auto" (see auto_backend_name)."""
    device = torch.device(device)
    if name == "auto":
        name = auto_backend_name(device)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKEND_NAMES)}"
        )
    if name in CUDA_ONLY_ATTENTION_BACKENDS and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")
    if name == "triton" and device.type != "cuda" and not triton_available(device):
        raise ValueError(
            "attention backend 'triton' needs a CUDA device; on a CPU it runs only in Triton's "
            "interpreter (TRITON_INTERPRET=1, for tests)"
        )
    if name not in available_backends(device):
        raise ValueError(
            f"attention backend {name!r} is not available here (available: {', '.join(available_backends(device))})"
        )
    return BACKENDS[name]()


class AttentionSplitter(Protocol):
    """Takes every layer's attention out of the forward pass while it is captured in pieces
    (engine/piecewise_graphs.py): given the queries (whose K/V are in the cache), returns the tensor
    the rest of the layer reads the attention's output from."""

    def split(self, layer: Attention, q: torch.Tensor, kv_cache: KVCache) -> torch.Tensor: ...


@dataclass
class AttentionStep:
    """One step's backend and its plan; lives only for one forward."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    plan: Any
    splitter: AttentionSplitter | None = None  # set while the forward is captured in pieces

    @classmethod
    def begin(
        cls, backend: AttentionBackend, metadata: AttentionMetadata, splitter: AttentionSplitter | None = None
    ) -> AttentionStep:
        # A split forward's attentions run on the splitter's own step: no plan here (a plan may launch
        # kernels, which would land in a captured piece).
        return cls(backend, metadata, None if splitter else backend.plan(metadata), splitter)


class Attention(nn.Module):
    """Paged-cache attention for one layer. No weights: projections live in the model.

    With a `sliding_window` W a query sees only the last W keys up to its own position (itself and the
    W - 1 before it: transformers' convention for Mistral, Qwen2 and Gemma 3). Every key stays in the
    cache (the layer's blocks are shared with its full-attention neighbours and the prefix cache);
    the backends just do not read the older ones."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be at least 1 token, not {sliding_window}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        step: AttentionStep,
    ) -> torch.Tensor:  # [T, Hq * D]
        k_cache, v_cache = kv_cache
        slots = step.metadata.slot_mapping
        # k_cache.view(-1, H, row)[slot_mapping] = k in the cache's format (index_copy_, without the
        # advanced-indexing temporaries; a q8_0 cache quantizes the rows first).
        write_kv(k_cache, slots, k)
        write_kv(v_cache, slots, v)
        return self.attend(q, kv_cache, step)

    def forward_rotary_qkv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], the fused projection (rotated in place)
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        step: AttentionStep,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,  # per-head norms of q and k (Qwen3, Gemma 3)
    ) -> torch.Tensor:  # [T, Hq * D]
        """Attention of a rotary model from its fused qkv: the q/k norms where the model has them,
        rotary on q and k, the cache write, then the backend. In float32 on a CPU the norms and the
        rest are two native calls (models/kernels/cpu.py), on a GPU all of it one Triton launch
        (triton_fused.py); the engine has already checked every position against the model's maximum."""
        t, d = qkv.shape[0], self.head_dim
        k_cache, v_cache = kv_cache
        cos_sin, slots = rotary.cos_sin_cache, step.metadata.slot_mapping
        fused = fused_ops(qkv)
        on_gpu = fused is not None and fused.fits_rope_and_cache(qkv, cos_sin, k_cache)
        norms = qk_norm if on_gpu and qk_norm is not None and qk_norm[0].pairs_with(qk_norm[1]) else None
        if qk_norm is not None and norms is None:  # the norms on their own (native or torch's ops)
            qkv = qk_rms_norm(qkv, *qk_norm, self.num_heads, self.num_kv_heads)
        if on_gpu:
            fused.rope_and_cache(qkv, positions, cos_sin, slots, k_cache, v_cache, self.num_heads, norms)
        elif cpu_kernels.fits_rope_and_cache(qkv, cos_sin, k_cache, d):
            cpu_kernels.rope_and_cache(qkv, positions, cos_sin, slots, k_cache, v_cache, self.num_heads)
        else:  # torch's ops: rotary, then forward's cache write and backend
            qk_heads = self.num_heads + self.num_kv_heads
            qk = rotary(positions, qkv[:, : qk_heads * d].view(t, qk_heads, d))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
            v = qkv[:, qk_heads * d :].view(t, self.num_kv_heads, d)
            return self.forward(q, k, v, kv_cache, step)
        return self.attend(qkv[:, : self.num_heads * d].view(t, self.num_heads, d), kv_cache, step)

    def attend(self, q: torch.Tensor, kv_cache: KVCache, step: AttentionStep) -> torch.Tensor:
        """The backend over a cache that already holds this step's K/V: [T, Hq, D] -> [T, Hq * D]
        (through the step's splitter while the forward is captured in pieces)."""
        if step.splitter is not None:
            return step.splitter.split(self, q, kv_cache)
        return self.run_backend(q, kv_cache, step)

    def run_backend(self, q: torch.Tensor, kv_cache: KVCache, step: AttentionStep) -> torch.Tensor:
        """[T, Hq, D] -> [T, Hq * D]: the step's backend."""
        k_cache, v_cache = kv_cache
        out = step.backend.forward(
            q, k_cache, v_cache, step.metadata, step.plan, self.scale, self.sliding_window
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
