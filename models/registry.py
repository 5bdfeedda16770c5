"""The model families this server runs: one line each (models/families/<name>.py declares the rest).

family = family_for(config)       # by the config's `architectures[0]`
support = gguf_support("llama")   # how a GGUF architecture is read, or None
"""

from __future__ import annotations

import importlib
from typing import Any

from models.errors import ModelLoadError
from models.family import GGUFSupport, ModelFamily

# models/families/<name>.py, each defining FAMILY. Adding a family: its file and its name here.
FAMILY_MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gpt2",
    "gemma3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
)

FAMILIES: tuple[ModelFamily, ...] = tuple(
    importlib.import_module(f"models.families.{name}").FAMILY for name in FAMILY_MODULES
)
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
_BY_GGUF_ARCHITECTURE = {
    arch: family.gguf for family in FAMILIES if family.gguf is not None for arch in family.gguf.architectures
}
# GGUF architectures read in place (others transformers reads are converted to float safetensors).
SUPPORTED_GGUF_ARCHITECTURES = tuple(_BY_GGUF_ARCHITECTURE)


def family_for(config: Any) -> ModelFamily:
    """The family serving a config's `architectures[0]`; a ModelLoadError naming what is supported."""
    architectures = getattr(config, "architectures", None) or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not architectures:
        raise ModelLoadError(f"config has no 'architectures' entry; supported architectures: {supported}")
    family = _BY_ARCHITECTURE.get(architectures[0])
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures[0]!r}; supported architectures: {supported}"
        )
    return family


def model_class_for(config: Any) -> type[Any]:
    return family_for(config).model


def gguf_support(gguf_architecture: str) -> GGUFSupport | None:
    """How a GGUF `general.architecture` is read: in place (a family declares it), or None (converted
    to float safetensors by transformers)."""
    return _BY_GGUF_ARCHITECTURE.get(gguf_architecture)
