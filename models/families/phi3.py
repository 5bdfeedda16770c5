"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): Llama's layers, from checkpoints that fuse q/k/v
into one `qkv_proj` tensor (q, k and v of different sizes under GQA) and gate/up into one
`gate_up_proj` (gate first), cut here by the layers' own shard sizes. Rotary may turn only part of a
head (Phi-4-mini: `partial_rotary_factor` 0.75, 96 of 128 dims) and scale with LongRoPE (Phi-3.5,
Phi-4-mini: short/long factors, `original_max_position_embeddings`, an attention factor;
models/layers/rotary.py).

GGUF files (`phi3`) keep the fused tensors (attn_qkv; ffn_up holds gate | up), so they are read in
place. They state the rotary width (rope.dimension_count), the original context and the attention
factor as metadata and the LongRoPE factors as tensors (rope_factors_long / _short), none of which
transformers' GGUF reader carries into its config: `phi3_gguf_config` does.
"""

from __future__ import annotations

from typing import Any

from models.families.llama import LLAMA_WEIGHT_NAMES, LlamaForCausalLM, llama_like_family
from models.family import GGUFMetadata, GGUFSupport, WeightNames, config_sliding_window

PHI3_WEIGHT_NAMES = WeightNames(
    layers="model.layers.",
    first_stage=("model.embed_tokens.",),
    last_stage=("model.norm.", "lm_head."),
    embedding="model.embed_tokens.weight",
    split=((".qkv_proj.", ("q", "k", "v")), (".gate_up_proj.", (0, 1))),
    ignored=LLAMA_WEIGHT_NAMES.ignored,
)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's graph: no biases, SiLU-gated MLP; the rotary differences are in the config."""


def phi3_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """The rotary width, LongRoPE and the window, as llama.cpp's converter wrote them."""
    head_dim = meta.arch_value("embedding_length") // meta.arch_value("attention.head_count")
    rotary = meta.arch_value("rope.dimension_count") or head_dim
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.arch_value("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary / head_dim,
    }
    out: dict[str, Any] = {}
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        original = meta.arch_value("rope.scaling.original_context_length") or meta.arch_value(
            "context_length"
        )
        params.update(
            rope_type="longrope",
            long_factor=[float(f) for f in long],
            short_factor=[float(f) for f in short],
            original_max_position_embeddings=int(original),
        )
        attention_factor = meta.arch_value("rope.scaling.attn_factor")
        if attention_factor is not None:
            params["attention_factor"] = float(attention_factor)
        out["original_max_position_embeddings"] = int(original)
    # llama.cpp writes 0 where the model has no window (Phi-4).
    out["sliding_window"] = meta.arch_value("attention.sliding_window") or None
    out["rope_parameters"] = params
    return out


FAMILY = llama_like_family(
    "phi3",
    Phi3ForCausalLM,
    PHI3_WEIGHT_NAMES,
    gguf=GGUFSupport(architectures=("phi3",), config=phi3_gguf_config),
    # Phi-3-mini-4k's window is 2047 (transformers masks with it); Phi-4-mini's is past its context.
    sliding_window=config_sliding_window,
)
