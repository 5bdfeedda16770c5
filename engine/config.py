"""Engine configuration and the resolution of its "auto" values (device, dtype, KV budget)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models.kernels.cpu import cpu_flags
from models.weight_packing import WEIGHT_PACKING_MODES

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# KV budget when neither num_kv_blocks nor kv_cache_memory is given.
CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32
CUDA_KV_MEMORY_FRACTION = 0.9  # of the memory still free once the weights are loaded


@dataclass
class EngineConfig:
    model: str = "default"  # "default", an HF directory, or a .gguf file
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # exact block count; wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for K and V of all layers together
    max_model_len: int | None = None  # None: the model's own maximum
    attention_backend: str = "auto"
    # "auto": on CPU in float32, weights that are exactly group-quantized (a GGUF model's) run on the
    # group-int8 kernel (models/weight_packing.py); "off": every weight stays float32.
    weight_packing: str = "auto"
    seed: int = 0  # seeds the engine generator used by unseeded sampled rows
    tensor_parallel_size: int = 1  # ranks that shard every layer (engine.distributed_executor)
    pipeline_parallel_size: int = 1  # stages the layers are split into (engine.distributed_executor)
    # Seconds a rank waits on a peer inside a step (and at start-up) before the engine declares it dead.
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weight_packing not in WEIGHT_PACKING_MODES:
            raise ValueError(
                f"weight_packing must be one of {WEIGHT_PACKING_MODES}, got {self.weight_packing!r}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(
                f"tensor/pipeline parallel sizes must be >= 1, got {self.tensor_parallel_size} / "
                f"{self.pipeline_parallel_size}"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix units (AMX or AVX512-BF16).

    Without them bf16 matmuls are emulated. On the 2-core AVX2 box this project is developed on, the
    engine's SmolLM2-135M decode step took 41 ms in bf16 against ~62 ms in float32 at batch 1 (bf16
    only wins where weight bandwidth dominates), 145 against 138 ms at batch 8, and 909 against
    190 ms at batch 32 (raw matmuls at batch 64: 2.8 s against 0.25 s), so serving batches is far
    faster in float32 there.
    """
    flags = cpu_flags()
    if flags:
        return bool(flags & {"amx_bf16", "avx512_bf16"})
    # No /proc (macOS, Windows): torch's dispatch level is the best hint left.
    return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        dtype = DTYPES[name]
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_model_path(model: str) -> Path:
    """The HF directory for `model` (the models package converts GGUF and resolves "default")."""
    from models.loader import resolve_model

    return Path(resolve_model(model))


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """--max-model-len may lower the model's own limit, never raise it (positions past it are untrained)."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's maximum {model_max}")
    return requested or model_max
