"""Model sources -> HF directories -> built, weight-loaded models (and their tokenizers).

    path = resolve_model("default" | "/some/hf-dir" | "/some/file.gguf")
    model = load_model(path, torch.bfloat16, torch.device("cuda"))
    tokenizer = load_tokenizer(path)

Every failure is one ModelLoadError whose message names the file and what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.errors import MissingWeightsError, ModelLoadError
from models.family import text_config
from models.gguf.convert import convert_gguf
from models.gguf.reader import GGUFWeights, has_manifest
from models.layers.parallel import PPContext, TPContext
from models.options import default_gguf_path
from models.registry import family_for
from models.weight_packing import linear_precision, pack_model_weights, should_pack
from models.weights_io import SafetensorsReader, matrices_all_16_bit, safetensors_files

__all__ = [
    "ModelLoadError",
    "is_16_bit_float_source",
    "is_block_quantized_source",
    "load_config",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "max_model_len",
    "resolve_model",
]

CONFIG_FILE = "config.json"


def resolve_model(source: str, need_weights: bool = True) -> Path:
    """A local HF directory, a .gguf file (converted once, then cached) or "default" -> an HF directory.
    need_weights=False (random weights, load_format "dummy") accepts a directory with a config alone."""
    if source == "default":
        return convert_gguf(default_gguf_path())
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: not a model (expected an HF directory or a .gguf file)")
        return convert_gguf(path)
    if not (path / CONFIG_FILE).is_file():
        raise ModelLoadError(f"{path}: no {CONFIG_FILE} in this directory (not an HF model directory)")
    # A converted GGUF directory reads its GGUF file instead of safetensors.
    if need_weights and not has_manifest(path):
        safetensors_files(path)  # fail now, not after the engine has started, when there are no weights
    return path


def is_block_quantized_source(source: str | Path) -> bool:
    """Whether a model source holds block-quantized weights the native kernels run: "default", a
    .gguf file, or a directory converted from one. (An HF directory of float weights that happen to
    be exactly block-structured is packed too, but is not told apart here without reading it.)"""
    if str(source) == "default":
        return True
    path = Path(source).expanduser()
    return path.suffix.lower() == ".gguf" or (path.is_dir() and has_manifest(path))


def is_16_bit_float_source(source: str | Path) -> bool:
    """Whether a model source is an HF directory whose matrices are stored as float16 or bfloat16: read
    as float32 they pack as F16/BF16 on the native kernels (weight_packing.py). Only where its float32
    copy, which loading holds before packing, fits in the memory available now (an 8B checkpoint's
    32 GB would not on most hosts: it then stays in bfloat16)."""
    path = Path(source).expanduser()
    if not (path.is_dir() and not has_manifest(path) and matrices_all_16_bit(path)):
        return False
    available = available_memory_bytes()
    return available is None or 2 * sum(f.stat().st_size for f in safetensors_files(path)) < 0.8 * available


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_config(path: Path) -> Any:
    from transformers import AutoConfig

    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: missing")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # json errors, unknown model_type, ...
        raise ModelLoadError(f"{config_file}: unreadable config ({type(e).__name__}: {e})") from None


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "auto",
    pp_rank: int = 0,
    pp_size: int = 1,
    weight_packing: str = "auto",
    load_format: str = "auto",
) -> nn.Module:
    """Build the model for an HF directory on `device` and stream its safetensors weights in (with
    load_format "dummy", fill it with random weights instead: see dummy_weights).

    With tp_size > 1 this process holds shard tp_rank of every sharded layer; with pp_size > 1 only
    pipeline stage pp_rank's layers (and the embedding / LM head if it is the first / last stage).
    weight_packing "auto" / "int8" / "float32" keeps block-quantized weights (GGUF's) packed for the
    CPU kernel, with int8 or float32 activations (models/weight_packing.py); "off" keeps every weight
    as a float tensor."""
    path = Path(path)
    device = torch.device(device)
    config = load_config(path)
    files = safetensors_files(path) if load_format != "dummy" and not has_manifest(path) else []
    tp = TPContext(tp_rank, tp_size, tp_group)
    pp = PPContext(pp_rank, pp_size)
    try:
        family = family_for(config)
        if tp_size > 1 and not family.tensor_parallel:
            raise ModelLoadError(f"the {family.name} family does not support tensor parallelism")
        # Parameters are allocated directly on the device (torch.empty: no init, no float32 detour).
        with torch.device(device):
            model = family.model(config, dtype=dtype, tp=tp, pp=pp)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path / CONFIG_FILE}: {e}") from None
    except ValueError as e:  # unsupported settings found while building (activation, head counts, ...)
        raise ModelLoadError(f"{path / CONFIG_FILE}: {e}") from None
    pack = family.packing and should_pack(weight_packing, device, dtype)
    if load_format == "dummy":
        dummy_weights(model)
        model.set_attention_backend(attention_backend, device)
        return model.eval()
    # A converted GGUF file is read in place; its quantized blocks go straight to packed weights.
    reader = (
        GGUFWeights(path, keep_quantized=pack) if has_manifest(path) else SafetensorsReader(files, device)
    )
    try:
        model.load_weights(reader)
    except ModelLoadError as e:
        # A missing weight is the directory's fault; anything else, the file being read.
        where = path if isinstance(e, MissingWeightsError) or reader.current is None else reader.current
        if str(where) in str(e):
            raise
        raise ModelLoadError(f"{where}: {e}") from None
    model.weight_file_bytes = reader.file_bytes  # what the start-up log weighs memory against
    if pack:
        pack_model_weights(model, linear_precision(weight_packing))
    model.set_attention_backend(attention_backend, device)
    return model.eval()


DUMMY_WEIGHT_RANGE = 1e-3  # vLLM's --load-format dummy draws from the same uniform range
DUMMY_WEIGHT_SEED = 0


def dummy_weights(model: nn.Module) -> None:
    """Every parameter uniform in [-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE], drawn on its own device from
    a fixed seed: a model with the checkpoint's shapes, dtype and cost per step (what benchmarks
    measure), without reading or even having its weights (an 8B model needs no 16 GB download)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(DUMMY_WEIGHT_SEED)
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen)


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' own model for a model directory: the parity reference and the benchmarks'
    baseline. A directory converted from a GGUF file holds no weights of its own (we read the GGUF
    file in place), so transformers reads that file, through its GGUF loader."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if has_manifest(path):
        gguf = GGUFWeights(path, keep_quantized=False).gguf
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def load_tokenizer(path: Path) -> Any:
    """The HF tokenizer of a model directory (its chat template included)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load tokenizer ({type(e).__name__}: {e})") from None


def max_model_len(config: Any) -> int:
    """Longest sequence the model supports, from its (text) config. A sliding window does not cap it:
    windowed layers attend to their last `window` keys of any longer history."""
    text = text_config(config)
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(text, attr, None)
        if value:
            return int(value)
    raise ModelLoadError("config has none of max_position_embeddings, n_positions, n_ctx")
