"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norms, head_dim from the
config) with a mixture of experts in place of the MLP on the layers `decoder_sparse_step` and
`mlp_only_layers` select (a dense MLP of `intermediate_size` on the others). Routing: softmax over the
experts, the top `num_experts_per_tok`, renormalised where `norm_topk_prob`. GGUF files (`qwen3moe`)
store each layer's experts as 3-D stacks (ffn_gate_exps, ffn_up_exps, ffn_down_exps)."""

from __future__ import annotations

from typing import Any

from torch import nn

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
from models.families.qwen3 import qwen3_layout
from models.family import GGUFMetadata
from models.layers.moe import Routing, check_routing


def is_sparse_layer(config: Any, index: int) -> bool:
    """transformers' rule for which Qwen2-MoE and Qwen3-MoE layers hold experts (a dense MLP on the
    others): every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return index not in only_dense and config.num_experts > 0 and (index + 1) % step == 0


def qwen3_moe_mlp(spec: LayerSpec, layout: LlamaLayout, index: int) -> nn.Module:
    config = spec.config
    if not is_sparse_layer(config, index):
        return llama_mlp(spec, layout)
    check_routing(config, "Qwen3-MoE")
    routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
    return sparse_mlp(spec, config.moe_intermediate_size, routing)


# llama.cpp's expert_gating_func ids (LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GGUF_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def qwen3_moe_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """What transformers' reader leaves at the config class's defaults: head_dim, each expert's
    intermediate size (expert_feed_forward_length), norm_topk_prob (llama.cpp's qwen3moe always
    renormalises the top k, as every published Qwen3-MoE sets), and the routing settings a file may
    state that this family's routing does not run (a gating function other than softmax, shared
    experts, scaled weights): carried into the config, so the model refuses them by name."""
    out: dict[str, Any] = {"norm_topk_prob": True}
    gating = meta.arch_value("expert_gating_func")
    if gating is not None:
        out["scoring_func"] = GGUF_GATING_FUNCS.get(int(gating), f"gating function {gating}")
    shared = meta.arch_value("expert_shared_count")
    if shared is not None:
        out["n_shared_experts"] = int(shared)
    scale = meta.arch_value("expert_weights_scale")
    if scale is not None:
        out["routed_scaling_factor"] = float(scale)
    head_dim = meta.arch_value("attention.key_length")
    if head_dim:
        out["head_dim"] = int(head_dim)
    return out | expert_width(meta)


def expert_width(meta: GGUFMetadata) -> dict[str, Any]:
    """Each expert's intermediate size (expert_feed_forward_length), which transformers' readers leave
    at the config class's default."""
    expert_ff = meta.arch_value("expert_feed_forward_length")
    return {"moe_intermediate_size": int(expert_ff)} if expert_ff else {}


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layout = staticmethod(qwen3_layout)
    layer_mlp = staticmethod(qwen3_moe_mlp)


FAMILY = moe_family(
    "qwen3_moe",
    Qwen3MoeForCausalLM,
    gguf=expert_gguf(("qwen3moe",), config=qwen3_moe_gguf_config),
    sliding_window=qwen2_sliding_window,
)
