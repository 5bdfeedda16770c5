"""Qwen2 (and Qwen2.5): Llama's layers with q/k/v biases (never on o_proj), and a sliding window only
where the config turns it on (`use_sliding_window`), on the layers from `max_window_layers` on (the
config's `layer_types`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from models.families.llama import LlamaForCausalLM, LlamaLayout, llama_like_family
from models.family import GGUFSupport


def qwen2_layout(config: PretrainedConfig) -> LlamaLayout:
    """Qwen2 always has q/k/v biases and no o_proj bias, whatever `attention_bias` says."""
    return dataclasses.replace(LlamaLayout.of(config), qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    layout = staticmethod(qwen2_layout)


def qwen2_sliding_window(config: Any) -> int | None:
    if not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) or None


FAMILY = llama_like_family(
    "qwen2", Qwen2ForCausalLM, gguf=GGUFSupport(architectures=("qwen2",)), sliding_window=qwen2_sliding_window
)
