"""Mixtral (8x7B, 8x22B): Mistral's layers with a mixture of experts in place of the MLP on every
layer: softmax over the `num_local_experts`, the top `num_experts_per_tok` renormalised to sum to 1
(transformers 5's order; equal to a softmax over the top k logits), each expert `intermediate_size`
wide. Checkpoints name the experts `block_sparse_moe.experts.N.w1/w2/w3` (gate/down/up).

Mixtral GGUF files carry the `llama` architecture with expert tensors; transformers reads them as
plain Llama configs, so they are not served from GGUF here yet."""

from __future__ import annotations

import dataclasses

from torch import nn

from models.base import LayerSpec
from models.families.llama import (
    MOE_WEIGHT_NAMES,
    LlamaForCausalLM,
    LlamaLayout,
    moe_family,
    sparse_mlp,
)
from models.family import config_sliding_window
from models.layers.moe import Routing, check_routing

MIXTRAL_WEIGHT_NAMES = dataclasses.replace(
    MOE_WEIGHT_NAMES,
    replaced=((".block_sparse_moe.", ".mlp."), (".w2.", ".down_proj.")),
    stacked=(*MOE_WEIGHT_NAMES.stacked, (".w1.", ".gate_up_proj.", 0), (".w3.", ".gate_up_proj.", 1)),
)


def mixtral_mlp(spec: LayerSpec, layout: LlamaLayout, index: int) -> nn.Module:
    config = spec.config
    check_routing(config, "Mixtral")
    routing = Routing(config.num_local_experts, config.num_experts_per_tok, normalize=True)
    return sparse_mlp(spec, config.intermediate_size, routing)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_mlp = staticmethod(mixtral_mlp)


FAMILY = moe_family("mixtral", MixtralForCausalLM, MIXTRAL_WEIGHT_NAMES, sliding_window=config_sliding_window)
