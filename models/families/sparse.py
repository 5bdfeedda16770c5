"""What the mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) share: Llama's layers with a
`SparseMoE` MLP (models/layers/moe.py) in place of the gated one, the checkpoint names of their
experts, and the refusal of routing variants their layer does not run.

Checkpoints name experts two ways, both read here: per expert (the hub's files and what transformers
5's save_pretrained writes: `mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1`)
and stacked (transformers 5's in-memory parameters, `mlp.experts.gate_up_proj` [E, 2 I, H] and
`mlp.experts.down_proj` [E, H, I]; a GGUF file's `ffn_*_exps`), cut into experts as they load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.base import LayerSpec
from models.errors import ModelLoadError
from models.families.llama import LLAMA_WEIGHT_NAMES
from models.layers.moe import MoESizes, Routing, SparseMoE

MOE_WEIGHT_NAMES = dataclasses.replace(
    LLAMA_WEIGHT_NAMES,
    experts=(
        (".experts.gate_up_proj", ".experts.{}.gate_up_proj.weight"),
        (".experts.down_proj", ".experts.{}.down_proj.weight"),
        (".experts.gate_proj", ".experts.{}.gate_proj.weight"),
        (".experts.up_proj", ".experts.{}.up_proj.weight"),
    ),
    # An expert's slice of a stacked gate_up_proj holds gate | up.
    split=((".gate_up_proj.", (0, 1)),),
)

# Routing settings of other MoE configs that change which experts a token takes or how their outputs
# are weighed, with the value under which this layer's routing is what they describe. A config that
# states another value is refused rather than run with the wrong routing.
ROUTING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
}


def check_routing(config: Any, family: str) -> None:
    """A ModelLoadError naming the first setting of `config` this server's routing does not run."""
    for key, accepted in ROUTING_DEFAULTS.items():
        if hasattr(config, key) and getattr(config, key) not in accepted:
            raise ModelLoadError(
                f"unsupported mixture-of-experts routing for {family}: {key}={getattr(config, key)!r} "
                f"(this server routes by softmax, then the top k, only: {key} must be "
                f"{' or '.join(repr(a) for a in accepted)})"
            )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported expert activation hidden_act={act!r} for {family} (only 'silu')")


def sparse_moe(
    spec: LayerSpec, expert_inter: int, routing: Routing, shared_inter: int = 0, shared_gate: bool = False
) -> SparseMoE:
    sizes = MoESizes(spec.config.hidden_size, expert_inter, shared_inter, shared_gate)
    return SparseMoE(sizes, routing, spec.dtype, spec.tp)


def is_sparse_layer(config: Any, index: int) -> bool:
    """transformers' rule for which Qwen2-MoE and Qwen3-MoE layers hold experts (a dense MLP on the
    others): every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return index not in only_dense and config.num_experts > 0 and (index + 1) % step == 0
