"""Engine configuration: the dataclass, its command-line flags, and the resolution of its "auto" values
(device, dtype, model path, maximum length).

Importing this module does not import torch (the server's flags and config are parsed before anything
heavy loads); the resolution functions import it when they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from engine.cli_args import FlagGroup, flag, size_arg
from models.options import ATTENTION_BACKEND_NAMES, KV_CACHE_DTYPE_NAMES, LOAD_FORMATS, WEIGHT_PACKING_MODES

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
CUDA_GRAPH_MODES = ("all", "decode")

# KV budget when neither num_kv_blocks nor kv_cache_memory is given.
CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32
CUDA_KV_MEMORY_FRACTION = 0.9  # of the memory still free once the weights are loaded


@dataclass
class EngineConfig(FlagGroup):
    FLAG_GROUP: ClassVar[str] = "engine"

    # "default", an HF directory, or a .gguf file
    model: str = flag("default", "HF model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    dtype: str = flag("auto", choices=("auto", *DTYPE_NAMES))
    device: str = flag("auto", "auto, cpu, cuda or cuda:N")
    block_size: int = flag(16, "tokens per KV block")
    # Exact block count; wins over kv_cache_memory (bytes for K and V of all layers together).
    num_kv_blocks: int | None = flag(None, "exact number of KV blocks", exclusive="kv")
    kv_cache_memory: int | None = flag(
        None,
        "KV cache bytes, suffixes allowed: 512MiB, 2GiB (default: 1 GiB on CPU, most of the free memory on CUDA)",
        type=size_arg,
        exclusive="kv",
    )
    # What the KV cache stores (engine/kv_cache.py resolves "auto"; models/layers/kv_format.py).
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache element type: auto (16-bit on CPU: bfloat16 for a bfloat16 model, else float16; the "
        "model's dtype on CUDA), float32, float16, bfloat16, or q8_0 (llama.cpp's blocks of 32 int8 "
        "values and one fp16 scale; CPU only). Smaller types fit more tokens in the same memory",
        choices=KV_CACHE_DTYPE_NAMES,
    )
    # None: the model's own maximum (a value may only lower it).
    max_model_len: int | None = flag(None, "cap on prompt + output tokens (default: the model's)")
    attention_backend: str = flag("auto", choices=ATTENTION_BACKEND_NAMES)
    weight_packing: str = flag(
        "auto",
        "auto: run exactly group-quantized weights (a GGUF model's) on the native CPU kernels, "
        "bit-identical weights in fewer bytes; off: keep them as floats",
        choices=WEIGHT_PACKING_MODES,
    )
    # Seeds the engine generator used by unseeded sampled rows.
    seed: int = flag(0, "seed for sampled requests that send none")
    # Ranks that shard every layer, and stages the layers are split into (engine.distributed_executor).
    tensor_parallel_size: int = flag(
        1,
        "ranks that split every layer; workers start on this machine, or under torchrun (docs/parallelism.md)",
        short="-tp",
    )
    pipeline_parallel_size: int = flag(
        1, "stages the layers are split into; that many batches are kept in flight", short="-pp"
    )
    # Seconds a rank waits on a peer inside a step (and at start-up) before the engine declares it dead.
    distributed_timeout_s: float = 300.0
    load_format: str = flag(
        "auto",
        "dummy: random weights of the model's shape (its config.json only, no weights read); for benchmarks",
        choices=LOAD_FORMATS,
    )
    # CUDA: run every step eagerly instead of replaying CUDA graphs for decode steps (vLLM's flag).
    enforce_eager: bool = flag(
        False,
        "CUDA: no CUDA graphs; every step runs eagerly (graphs replay decode steps of up to --max-num-seqs "
        "sequences)",
        action="store_true",
    )
    # CUDA: which steps replay graphs. "all": decode steps whole (engine/cuda_graphs.py), every other
    # step of up to --max-num-batched-tokens tokens in pieces between its attentions
    # (engine/piecewise_graphs.py); "decode": decode steps only, the rest eagerly.
    cuda_graphs: str = flag(
        "all",
        "CUDA: steps that replay graphs: all (decode steps whole, the others in pieces between attentions) "
        "or decode (decode steps only)",
        choices=CUDA_GRAPH_MODES,
    )
    # Speculative decoding: a smaller model with the same tokenizer that proposes tokens for the target
    # to verify (engine/draft_proposer.py; the scheduler's --speculative picks it when it is given).
    draft_model: str | None = flag(
        None,
        "draft model for speculative decoding (an HF directory or .gguf file with the model's tokenizer); "
        "one process only",
    )
    # The most sequences one step holds: the scheduler's max_num_seqs, which has the one flag and the one
    # default (ServerConfig passes it down; from_cli_args reads it where a parser has the scheduler's
    # flags). It bounds the batch sizes decode graphs are captured for; None (the engine used without a
    # scheduler, and not told) captures none.
    max_num_seqs: int | None = None
    # The most tokens one step holds: the scheduler's max_num_batched_tokens, passed down the same way.
    # It bounds the token counts piecewise graphs are captured for; None captures none.
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKEND_NAMES}, got {self.attention_backend!r}"
            )
        if self.weight_packing not in WEIGHT_PACKING_MODES:
            raise ValueError(
                f"weight_packing must be one of {WEIGHT_PACKING_MODES}, got {self.weight_packing!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}"
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
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")


def resolve_device(name: str) -> torch.device:
    import torch

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
    import torch

    from models.kernels.cpu import cpu_flags

    flags = cpu_flags()
    if flags:
        return bool(flags & {"amx_bf16", "avx512_bf16"})
    # No /proc (macOS, Windows): torch's dispatch level is the best hint left.
    return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")


def resolve_dtype(name: str, device: torch.device, model: str | Path | None = None) -> torch.dtype:
    """The model dtype "auto" means. On a CPU with the native kernels, float32 for a block-quantized
    checkpoint (a GGUF file, the default model; `model` None assumes one): its linear layers then run
    on the quantized kernels with int8 activations and everything else in float32, faster than
    torch's bf16 path at every batch size (SmolLM2-135M Q4_1, one core of a Sapphire Rapids-class
    Xeon with AMX: 66 / 305 / 598 tok/s at batch 1 / 8 / 64 against 19 / 127 / 430 in bf16). float32
    too for a checkpoint stored in 16-bit floats (most HF checkpoints): its linear weights stay 16-bit
    on the native kernels and multiply float32 activations (SmolLM2-135M's shape in bf16, 2-core
    AVX-512 BF16 EPYC: 81.7 / 448 / 574 tok/s at batch 1 / 8 / 32 against torch's bf16 path's 26.0 /
    147 / 285; a 512-token prefill 595 against 988 tok/s). A float32 checkpoint runs on torch's
    matmuls: bf16 where the CPU has bf16 matrix units, float32 elsewhere."""
    import torch

    if name != "auto":
        dtype = getattr(torch, name)
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from models.kernels import cpu as cpu_kernels
    from models.loader import is_16_bit_float_source, is_block_quantized_source

    if cpu_kernels.available() and (
        model is None or is_block_quantized_source(model) or is_16_bit_float_source(model)
    ):
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_model_path(model: str, load_format: str = "auto") -> Path:
    """The HF directory for `model` (the models package converts GGUF and resolves "default"); with the
    "dummy" load format a directory needs its config.json only."""
    from models.loader import resolve_model

    return Path(resolve_model(model, need_weights=load_format != "dummy"))


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """--max-model-len may lower the model's own limit, never raise it (positions past it are untrained)."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's maximum {model_max}")
    return requested or model_max
