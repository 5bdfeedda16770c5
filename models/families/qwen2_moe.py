"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases where `qkv_bias`)
with a mixture of experts on the layers `decoder_sparse_step` and `mlp_only_layers` select, routed as
Qwen3-MoE's (softmax, top k, renormalised where `norm_topk_prob`), plus a shared expert every token
takes (`shared_expert`, `shared_expert_intermediate_size` wide), scaled per token by
sigmoid(`shared_expert_gate`). GGUF files (`qwen2moe`) hold the experts as 3-D stacks and the shared
expert as ffn_*_shexp, its gate as the vector ffn_gate_inp_shexp."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from models.base import LayerSpec
from models.families.llama import (
    LlamaForCausalLM,
    LlamaLayout,
    expert_gguf,
    llama_mlp,
    moe_family,
    sparse_mlp,
)
from models.families.qwen2 import qwen2_sliding_window
from models.families.qwen3_moe import expert_width, is_sparse_layer
from models.family import GGUFMetadata
from models.layers.moe import Routing, check_routing


def qwen2_moe_layout(config: PretrainedConfig) -> LlamaLayout:
    """q/k/v biases as `qkv_bias` says (Qwen2MoeConfig's default: on), never on o_proj."""
    return dataclasses.replace(
        LlamaLayout.of(config), qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False
    )


def qwen2_moe_mlp(spec: LayerSpec, layout: LlamaLayout, index: int) -> nn.Module:
    config = spec.config
    if not is_sparse_layer(config, index):
        return llama_mlp(spec, layout)
    check_routing(config, "Qwen2-MoE")
    routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return sparse_mlp(spec, config.moe_intermediate_size, routing, shared, shared_gate=shared > 0)


def qwen2_moe_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """The widths transformers' reader leaves at Qwen2MoeConfig's defaults (1408 and 5632): each
    expert's (expert_feed_forward_length) and the shared expert's
    (expert_shared_feed_forward_length)."""
    out = expert_width(meta)
    shared_ff = meta.arch_value("expert_shared_feed_forward_length")
    if shared_ff:
        out["shared_expert_intermediate_size"] = int(shared_ff)
    return out


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layout = staticmethod(qwen2_moe_layout)
    layer_mlp = staticmethod(qwen2_moe_mlp)


FAMILY = moe_family(
    "qwen2_moe",
    Qwen2MoeForCausalLM,
    gguf=expert_gguf(("qwen2moe",), config=qwen2_moe_gguf_config),
    sliding_window=qwen2_sliding_window,
)
