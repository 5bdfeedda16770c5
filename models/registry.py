"""HF `architectures[0]` -> our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from models.errors import ModelLoadError


def _llama() -> type[nn.Module]:
    from models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _gpt2() -> type[nn.Module]:
    from models.gpt2 import GPT2LMHeadModel

    return GPT2LMHeadModel


# Lazy, so importing the registry does not import every model family.
_ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
    "GPT2LMHeadModel": _gpt2,
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def model_class_for(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(
            f"config has no 'architectures' entry; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCHITECTURES[arch]()
