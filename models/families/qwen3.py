"""Qwen3 (dense: 0.6B to 32B): Llama's layers with a per-head RMSNorm of q and k before rotary
(`q_norm`, `k_norm`: weights [head_dim] shared by the heads), no q/k/v biases unless the config's
`attention_bias` says so, and head_dim from the config (128 throughout the family, where
hidden / heads would give 64 for the 0.6B). GGUF files (`qwen3`) name these tensors attn_q_norm and
attn_k_norm and store q and k unpermuted, so they are read in place."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from models.families.llama import LlamaForCausalLM, LlamaLayout, llama_like_family
from models.families.qwen2 import qwen2_sliding_window
from models.family import GGUFMetadata, GGUFSupport


def qwen3_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """head_dim: the file states it (attention.key_length), transformers' reader leaves the config
    class's default (128, right for every published Qwen3, wrong for any other size)."""
    head_dim = meta.arch_value("attention.key_length")
    return {"head_dim": int(head_dim)} if head_dim else {}


def qwen3_layout(config: PretrainedConfig) -> LlamaLayout:
    return dataclasses.replace(LlamaLayout.of(config), qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layout = staticmethod(qwen3_layout)


FAMILY = llama_like_family(
    "qwen3",
    Qwen3ForCausalLM,
    gguf=GGUFSupport(architectures=("qwen3",), config=qwen3_gguf_config),
    # Qwen3's window, like Qwen2's, is in force only where `use_sliding_window` turns it on.
    sliding_window=qwen2_sliding_window,
)
