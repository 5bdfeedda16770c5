"""Mistral: Llama's layers and checkpoint names; the config's `sliding_window` is always in force.

Mistral GGUF files carry the `llama` architecture, so they load through the Llama family's GGUF support
(transformers reads them as Llama configs).
"""

from __future__ import annotations

from typing import Any

from models.families.llama import LLAMA_WEIGHT_NAMES, LlamaForCausalLM, llama_decode_parts
from models.family import ModelFamily


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's graph (Mistral's differences are in its config: GQA, rope theta, the window)."""


def mistral_sliding_window(config: Any) -> int | None:
    return getattr(config, "sliding_window", None) or None


FAMILY = ModelFamily(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model=MistralForCausalLM,
    weights=LLAMA_WEIGHT_NAMES,
    native_decode=llama_decode_parts,
    sliding_window=mistral_sliding_window,
)
