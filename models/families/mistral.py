"""Mistral: Llama's layers and checkpoint names; the config's `sliding_window`, where set, is in force
on every layer.

Mistral GGUF files carry the `llama` architecture, so they load through the Llama family's GGUF support
(transformers reads them as Llama configs).
"""

from __future__ import annotations

from models.families.llama import LlamaForCausalLM, llama_like_family
from models.family import config_sliding_window


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's graph (Mistral's differences are in its config: GQA, rope theta, the window)."""


FAMILY = llama_like_family("mistral", MistralForCausalLM, sliding_window=config_sliding_window)
