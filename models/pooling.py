"""How a model's final hidden states become one embedding: read from what the model's files say.

In order: the GGUF file's `<arch>.pooling_type` (kept by the GGUF conversion as POOLING_FILE in the
converted directory), a sentence-transformers Pooling module (`modules.json` naming its folder, whose
`config.json` sets one `pooling_mode_*`; Qwen3-Embedding ships `pooling_mode_lasttoken`), else the last
token's state, what decoder embedding models use and vLLM's default for a causal LM. A model whose
files name a pooling that no embedding can be made with here (GGUF `none`: per-token vectors; `rank`: a
reranker's classification head; sentence-transformers' max or weighted mean) has no method and says
why. Torch-free: the server reads it once the model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# The methods an embedding can be pooled with (engine.contract.Pooling names the same three).
PoolingMethod = Literal["last", "mean", "cls"]

# Written by the GGUF conversion (models/gguf/convert.py): {"pooling_type": <GGUF's name>}.
POOLING_FILE = "gguf_pooling.json"
# llama.cpp's enum llama_pooling_type (gguf.PoolingType), by value.
GGUF_POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_SENTENCE_TRANSFORMERS_POOLING = "sentence_transformers.models.Pooling"
_SENTENCE_TRANSFORMERS_MODES: dict[str, PoolingMethod | None] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass(frozen=True)
class ModelPooling:
    """A model's pooling: `method`, or None with `problem` saying why it cannot embed; `source` says
    where it was read (for logs and error messages)."""

    method: PoolingMethod | None
    source: str
    problem: str | None = None


DECODER_DEFAULT = ModelPooling("last", "the default for a decoder model (no pooling configured)")


def model_pooling(model_dir: Path) -> ModelPooling:
    """The pooling `model_dir`'s files declare (see the module's docstring for the order)."""
    gguf = model_dir / POOLING_FILE
    if gguf.is_file():
        return _from_gguf(str(_read_json(gguf).get("pooling_type")))
    found = _from_sentence_transformers(model_dir)
    return found if found is not None else DECODER_DEFAULT


def gguf_pooling_name(value: Any) -> str | None:
    """The name of a GGUF `<arch>.pooling_type` value; None when it is absent or unspecified (-1)."""
    return GGUF_POOLING_TYPES.get(value) if isinstance(value, int) else None


def _from_gguf(name: str) -> ModelPooling:
    source = f"the GGUF file's pooling_type ({name})"
    if name in ("last", "mean", "cls"):
        return ModelPooling(name, source)  # type: ignore[arg-type]
    why = {
        "none": "it gives one vector per token, not one per input",
        "rank": "it is a reranker whose classification head this server does not run",
    }.get(name, "the value is unknown")
    return ModelPooling(None, source, f"the GGUF file's pooling_type is {name!r}: {why}")


def _from_sentence_transformers(model_dir: Path) -> ModelPooling | None:
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    entries = _read_json(modules)
    folder = next(
        (
            m.get("path")
            for m in entries
            if isinstance(m, dict) and m.get("type") == _SENTENCE_TRANSFORMERS_POOLING
        ),
        None,
    )
    if not isinstance(folder, str) or not (model_dir / folder / "config.json").is_file():
        return None
    config = _read_json(model_dir / folder / "config.json")
    source = f"sentence-transformers' {folder}/config.json"
    modes = [key for key in _SENTENCE_TRANSFORMERS_MODES if config.get(key)]
    methods = [_SENTENCE_TRANSFORMERS_MODES[key] for key in modes]
    if len(methods) == 1 and methods[0] is not None:
        return ModelPooling(methods[0], source)
    if not modes:
        return ModelPooling(None, source, f"{source} sets no pooling mode")
    return ModelPooling(
        None, source, f"{source} pools with {' + '.join(modes)}, which this server does not do"
    )


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
