"""Llama (Llama 2/3, SmolLM) for selective batching; Mistral, Qwen2 and Qwen3 reuse its layers (their own
files), with what differs read off their configs into a `LlamaLayout`.

All linear layers, norms and the MLP run once over the flat [T, hidden] tokens of every request in the
step; only the attention op splits per request. q/k/v and gate/up are fused into single matmuls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from models.base import CausalLMBase, LayerSpec, stage_layers
from models.family import GGUFMetadata, GGUFSupport, ModelFamily, WeightNames
from models.layers.activation import SiluAndMul
from models.layers.attention import Attention, AttentionStep
from models.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from models.layers.metadata import KVCache
from models.layers.mlp import GatedMLP
from models.layers.moe import MoESizes, Routing, SparseMoE
from models.layers.native_decode import DecodeLayerParts
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE_STAGE, PPContext, TPContext
from models.layers.rotary import RotaryEmbedding, rope_params_from_config

# The checkpoint names of a Llama-layout model (Mistral and Qwen2 share them).
LLAMA_WEIGHT_NAMES = WeightNames(
    layers="model.layers.",
    first_stage=("model.embed_tokens.",),
    last_stage=("model.norm.", "lm_head."),
    embedding="model.embed_tokens.weight",
    stacked=(
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ),
    # Buffers some checkpoints carry that are recomputed here.
    ignored=("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"),
)


# The mixture-of-experts families' (models/layers/moe.py's SparseMoE in place of the MLP). Checkpoints
# name experts two ways, both read: per expert (the hub's files and what transformers 5's
# save_pretrained writes: `mlp.experts.3.gate_proj.weight`) and stacked (transformers 5's in-memory
# parameters `mlp.experts.gate_up_proj` [E, 2 I, H] and `down_proj` [E, H, I]; a GGUF file's
# `ffn_*_exps`), cut into experts as they load.
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


@dataclass(frozen=True)
class LlamaLayout:
    """What varies between the families that share these layers, read off a config once."""

    head_dim: int
    num_kv_heads: int
    qkv_bias: bool  # biases on q, k and v
    o_bias: bool  # a bias on the attention output projection
    mlp_bias: bool
    qk_norm: bool = False  # a per-head RMSNorm of q and k before rotary (Qwen3)

    @classmethod
    def of(cls, config: PretrainedConfig) -> LlamaLayout:
        """Llama's: `attention_bias` covers all four attention projections."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, spec: LayerSpec, layout: LlamaLayout):
        super().__init__()
        config, dtype, tp = spec.config, spec.dtype, spec.tp
        head_dim = layout.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            layout.num_kv_heads,
            layout.qkv_bias,
            dtype,
            tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            layout.o_bias,
            dtype,
            tp,
            input_shard=self.qkv_proj.q_shard,
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary = spec.rotary  # shared by all layers (one cos/sin table)
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, spec.window)
        # Weights [head_dim], the same for every head (and so on every tensor-parallel rank).
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if layout.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if layout.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, step: AttentionStep):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        return self.o_proj(self.attn.forward_rotary_qkv(qkv, positions, self.rotary, kv_cache, step, qk_norm))


def llama_mlp(spec: LayerSpec, layout: LlamaLayout) -> GatedMLP:
    config = spec.config
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for a Llama-family model")
    return GatedMLP(
        config.hidden_size, config.intermediate_size, layout.mlp_bias, SiluAndMul(), spec.dtype, spec.tp
    )


# Decoder layer i's MLP: the gated MLP, or a family's own (a mixture of experts: sparse_mlp).
MLPBuilder = Callable[[LayerSpec, LlamaLayout, int], nn.Module]


def dense_mlp(spec: LayerSpec, layout: LlamaLayout, index: int) -> nn.Module:
    return llama_mlp(spec, layout)


def sparse_mlp(
    spec: LayerSpec, expert_inter: int, routing: Routing, shared_inter: int = 0, shared_gate: bool = False
) -> SparseMoE:
    """A mixture of experts in place of the MLP: `routing.num_experts` of `expert_inter`, and a shared
    expert of `shared_inter` (0: none), behind a sigmoid gate where `shared_gate`."""
    sizes = MoESizes(spec.config.hidden_size, expert_inter, shared_inter, shared_gate)
    return SparseMoE(sizes, routing, spec.dtype, spec.tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec, layout: LlamaLayout, mlp: nn.Module, attention: type[nn.Module]):
        super().__init__()
        config = spec.config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.dtype)
        self.self_attn = attention(spec, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.dtype)
        self.mlp = mlp

    def forward(self, positions, hidden, kv_cache: KVCache, step: AttentionStep) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, step)
        # The residual add is fused into the norm (hidden is the updated residual stream after it).
        normed, hidden = self.post_attention_layernorm(attn_out, residual=hidden)
        return hidden + self.mlp(normed)


class LlamaModel(nn.Module):
    """Embedding on the first pipeline stage, this stage's decoder layers, final norm on the last."""

    def __init__(
        self,
        config: PretrainedConfig,
        layout: LlamaLayout,
        dtype: torch.dtype,
        tp: TPContext,
        pp: PPContext = SINGLE_STAGE,
        windows: tuple[int | None, ...] | None = None,  # each layer's sliding window (None: none)
        mlp: MLPBuilder = dense_mlp,
        attention: type[nn.Module] | None = None,  # LlamaAttention unless a family has its own
    ):
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp) if pp.is_first else None
        )
        rotary = RotaryEmbedding(
            layout.head_dim, config.max_position_embeddings, rope_params_from_config(config), dtype
        )
        windows = windows or (None,) * config.num_hidden_layers

        def layer(i: int) -> LlamaDecoderLayer:
            spec = LayerSpec(config, rotary, dtype, tp, windows[i])
            return LlamaDecoderLayer(spec, layout, mlp(spec, layout, i), attention or LlamaAttention)

        self.layers = stage_layers(config.num_hidden_layers, pp, layer)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if pp.is_last else None


class LlamaForCausalLM(CausalLMBase):
    """The Llama graph; a family with the same layers and other config flags subclasses it and
    overrides `layout` (and `layer_mlp` for another MLP, `layer_attention` for another attention module)."""

    layout = staticmethod(LlamaLayout.of)
    layer_mlp: ClassVar[MLPBuilder] = staticmethod(dense_mlp)
    layer_attention: ClassVar[type[nn.Module] | None] = None

    def build(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        tp, pp = self.tp, self.pp
        windows = self.family.layer_windows(config)
        self.model = LlamaModel(
            config, self.layout(config), dtype, tp, pp, windows, self.layer_mlp, self.layer_attention
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tie_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = self.build_lm_head(config.hidden_size, dtype, tp, pp, tie_to=tie_to)
        first = self.model.layers[self.stage_layers.start]
        self.set_sizes(config.hidden_size, config.vocab_size, first.self_attn.attn)


def llama_decode_parts(layer: nn.Module) -> DecodeLayerParts:
    """A Llama decoder layer as the native decode call runs it; its MLP dense or a mixture of experts."""
    attn, mlp = layer.self_attn, layer.mlp
    experts = mlp if isinstance(mlp, SparseMoE) else None
    return DecodeLayerParts(
        input_norm=layer.input_layernorm,
        qkv=attn.qkv_proj,
        rotary=attn.rotary,
        attention=attn.attn,
        o=attn.o_proj,
        post_norm=layer.post_attention_layernorm,
        gate_up=None if experts else mlp.gate_up_proj,
        down=None if experts else mlp.down_proj,
        q_norm=attn.q_norm,
        k_norm=attn.k_norm,
        experts=experts,
    )


def llama_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """A Mixtral file's experts (llama_gguf_experts). Llama 3.1+ files carry their llama3 rope scaling
    as per-frequency divisors (the rope_freqs tensor llama.cpp's converter computes from factor,
    low/high_freq_factor and the original context), which transformers' GGUF reader drops. Kept as
    one LongRoPE set for every position (its original context the whole context, so no long set and
    an attention factor of 1): the frequencies llama.cpp turns with, inv_freq / factor."""
    factors = meta.tensor("rope_freqs.weight")
    if factors is None:
        return llama_gguf_experts(meta)
    per_frequency = [float(f) for f in factors]
    return {
        **llama_gguf_experts(meta),
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": float(meta.arch_value("rope.freq_base", 10000.0)),
            "short_factor": per_frequency,
            "long_factor": per_frequency,
            "original_max_position_embeddings": int(meta.arch_value("context_length")),
            "attention_factor": 1.0,
        },
    }


# llama.cpp's expert stacks [experts, rows, cols] under the names MOE_WEIGHT_NAMES unstacks, in every
# MoE architecture's files (a llama one's: Mixtral's).
GGUF_EXPERT_TENSORS = (
    ("ffn_gate_exps.weight", "mlp.experts.gate_proj"),
    ("ffn_up_exps.weight", "mlp.experts.up_proj"),
    ("ffn_down_exps.weight", "mlp.experts.down_proj"),
)


def llama_gguf_model_type(meta: GGUFMetadata) -> str | None:
    """A `llama` file with experts (expert_count) is a Mixtral: llama.cpp writes Mixtral under the
    llama architecture, and transformers' reader would take it for a dense Llama."""
    return "mixtral" if meta.arch_value("expert_count") else None


def llama_gguf_experts(meta: GGUFMetadata) -> dict[str, Any]:
    """A Mixtral file's experts: their count, how many a token takes, and their width (llama.cpp
    writes it as feed_forward_length, or expert_feed_forward_length where it states one)."""
    experts = meta.arch_value("expert_count")
    if not experts:
        return {}
    width = meta.arch_value("expert_feed_forward_length") or meta.arch_value("feed_forward_length")
    return {
        "num_local_experts": int(experts),
        "num_experts_per_tok": int(meta.arch_value("expert_used_count", 2)),
        "intermediate_size": int(width),
    }


def llama_like_family(
    name: str, model: type[LlamaForCausalLM], weights: WeightNames = LLAMA_WEIGHT_NAMES, **declared: Any
) -> ModelFamily:
    """A family with Llama's layers, served by `model` (its class name is the HF architecture): Llama's
    checkpoint names and native decode layout unless it declares otherwise."""
    return ModelFamily(
        name=name,
        architectures=(model.__name__,),
        model=model,
        weights=weights,
        **{"native_decode": llama_decode_parts, **declared},
    )


def moe_family(
    name: str, model: type[LlamaForCausalLM], weights: WeightNames = MOE_WEIGHT_NAMES, **declared: Any
) -> ModelFamily:
    """A family with Llama's layers and a mixture of experts for MLPs (models/layers/moe.py)."""
    return llama_like_family(name, model, weights, **declared)


def expert_gguf(architectures: tuple[str, ...], **declared: Any) -> GGUFSupport:
    """GGUF support for a mixture-of-experts architecture: its 3-D expert stacks read as block tensors."""
    return GGUFSupport(architectures=architectures, block_tensors=GGUF_EXPERT_TENSORS, **declared)


FAMILY = llama_like_family(
    "llama",
    LlamaForCausalLM,
    # llama.cpp's converter permutes q/k rows for rotary; transformers' GGUF loader undoes it.
    gguf=GGUFSupport(
        architectures=("llama",),
        permute_qk=True,
        config=llama_gguf_config,
        block_tensors=GGUF_EXPERT_TENSORS,
        model_type=llama_gguf_model_type,
    ),
)
