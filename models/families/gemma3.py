"""Gemma 3 (text): `Gemma3ForCausalLM`, the language model of `Gemma3ForConditionalGeneration` (its
vision tower is not loaded), and GGUF `gemma3` files.

What differs from Llama, all read off the (text) config:
- four RMSNorms per layer: input, post-attention (on the attention output, before its residual add),
  pre- and post-feedforward (the same around the MLP); per-head q/k RMSNorms before rotary. Every one
  scales by (1 + w): folded into the stored weight when it is loaded (`GemmaRMSNorm`);
- a GELU-tanh gated MLP;
- embeddings scaled by sqrt(hidden), the factor rounded to the model dtype first (as transformers);
- attention scaled by query_pre_attn_scalar^-0.5;
- local layers (`layer_types` "sliding_attention") with the sliding window and their own rotary
  (`rope_parameters["sliding_attention"]`: rope_local_base_freq, no scaling), global layers with
  `rope_parameters["full_attention"]` (rope_theta, and rope_scaling where set);
- a tied LM head, and final logit soft-capping where the config sets it (Gemma 3's are null; attention
  soft-capping is refused: no backend applies it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from models.base import CausalLMBase, LayerSpec, stage_layers
from models.errors import ModelLoadError
from models.families.llama import LLAMA_WEIGHT_NAMES, llama_decode_parts
from models.family import FULL, SLIDING, GGUFMetadata, GGUFSupport, ModelFamily, config_sliding_window
from models.layers.activation import GeluTanhAndMul
from models.layers.attention import Attention, AttentionStep
from models.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from models.layers.metadata import KVCache
from models.layers.mlp import GatedMLP
from models.layers.native_decode import DecodeLayerParts
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE_STAGE, PPContext, TPContext
from models.layers.rotary import RotaryEmbedding, rope_params_from_config

# Llama's names; a multimodal checkpoint keeps its language model under its own prefix (hub files:
# "language_model.model.", transformers 5's own names: "model.language_model."), and its vision tower
# and projector are not used.
GEMMA3_WEIGHT_NAMES = dataclasses.replace(
    LLAMA_WEIGHT_NAMES,
    renamed=(
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("vision_tower.", None),
        ("multi_modal_projector.", None),
        ("model.vision_tower.", None),
        ("model.multi_modal_projector.", None),
    ),
)


def _fold_one_plus(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Store 1 + w, computed in float32 as transformers' Gemma3RMSNorm computes it every forward."""
    default_weight_loader(param, 1.0 + loaded.float(), shard_id)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32 whatever the model dtype, then cast back.

    The weight holds 1 + w (float32), folded in once when it is loaded, so in float32 this is a plain
    RMSNorm: the native kernel and the fused decode call run it as they run Llama's, bit for bit."""

    scale_in_float32 = True

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, torch.float32)
        self.weight.weight_loader = _fold_one_plus  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Unlike Llama (normalise, cast, then scale in the model dtype): scale in float32, then cast.
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, spec: LayerSpec):
        super().__init__()
        config, dtype, tp = spec.config, spec.dtype, spec.tp
        hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, heads, config.num_key_value_heads, bias, dtype, tp
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim, hidden, bias, dtype, tp, input_shard=self.qkv_proj.q_shard
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = spec.rotary  # this layer type's table, shared by the layers of its type
        scale = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, scale, spec.window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, step: AttentionStep):
        qkv, qk_norm = self.qkv_proj(x), (self.q_norm, self.k_norm)
        return self.o_proj(self.attn.forward_rotary_qkv(qkv, positions, self.rotary, kv_cache, step, qk_norm))


def gemma3_mlp(spec: LayerSpec) -> GatedMLP:
    config = spec.config
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3 (expected gelu_pytorch_tanh)")
    return GatedMLP(
        config.hidden_size, config.intermediate_size, False, GeluTanhAndMul(), spec.dtype, spec.tp
    )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec):
        super().__init__()
        hidden, eps = spec.config.hidden_size, spec.config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(spec)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = gemma3_mlp(spec)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, hidden, kv_cache: KVCache, step: AttentionStep) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, step)
        # The post-attention norm, the residual add and the pre-feedforward norm, fused where they can
        # be (hidden is the updated stream after); then the post-feedforward norm and its residual add.
        normed, hidden = self.post_attention_layernorm.norm_then(
            attn_out, self.pre_feedforward_layernorm, hidden
        )
        return self.post_feedforward_layernorm.add_to(self.mlp(normed), hidden)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times sqrt(hidden), the factor rounded to the model dtype first (transformers'
    Gemma3TextScaledWordEmbedding: 55.4256 becomes 55.5 in bfloat16)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, tp: TPContext) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp)
        self.register_buffer("normalizer", torch.tensor(embedding_dim**0.5, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.normalizer


class Gemma3Model(nn.Module):
    """Embedding on the first pipeline stage, this stage's decoder layers, final norm on the last."""

    def __init__(
        self,
        config: PretrainedConfig,  # the text config
        windows: tuple[int | None, ...],
        dtype: torch.dtype,
        tp: TPContext,
        pp: PPContext = SINGLE_STAGE,
    ):
        super().__init__()
        self.embed_tokens = (
            ScaledEmbedding(config.vocab_size, config.hidden_size, dtype, tp) if pp.is_first else None
        )
        # One rotary table per layer type present: the local layers' and the global layers'.
        types = [SLIDING if w is not None else FULL for w in windows]
        rotary = {
            t: RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, rope_params_from_config(config, t), dtype
            )
            for t in dict.fromkeys(types)
        }
        self.rotary_local = rotary.get(SLIDING)  # registered, so they move with the model
        self.rotary_global = rotary.get(FULL)
        self.layers = stage_layers(
            config.num_hidden_layers,
            pp,
            lambda i: Gemma3DecoderLayer(LayerSpec(config, rotary[types[i]], dtype, tp, windows[i])),
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None


def _check_supported(text: PretrainedConfig) -> None:
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")


class Gemma3ForCausalLM(CausalLMBase):
    """Built from a Gemma3TextConfig, or a Gemma3Config (its text_config: the language model)."""

    def build(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        _check_supported(config)
        tp, pp = self.tp, self.pp
        self.model = Gemma3Model(config, self.family.layer_windows(self.config), dtype, tp, pp)
        self.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", True))
        tie_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = self.build_lm_head(config.hidden_size, dtype, tp, pp, tie_to=tie_to)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)
        first = self.model.layers[self.stage_layers.start]
        self.set_sizes(config.hidden_size, config.vocab_size, first.self_attn.attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma3_decode_parts(layer: nn.Module) -> DecodeLayerParts:
    """A Gemma 3 decoder layer as the native decode call runs it: Llama's parts, but its pre-feedforward
    norm is the fused add + norm before the MLP, and the post-attention and post-feedforward norms
    apply to each branch's output before its residual add."""
    return dataclasses.replace(
        llama_decode_parts(layer),
        post_norm=layer.pre_feedforward_layernorm,
        attn_out_norm=layer.post_attention_layernorm,
        mlp_out_norm=layer.post_feedforward_layernorm,
        activation="gelu_tanh",
    )


# llama.cpp's gemma3 model type for 62 layers, whose attention scale is 1/sqrt(hidden / heads).
GEMMA3_27B_LAYERS = 62


def gemma3_gguf_config(meta: GGUFMetadata, config: Any) -> dict[str, Any]:
    """What transformers' GGUF reader leaves out of a gemma3 file's config, read as llama.cpp reads it:
    the global layers' linear rope scaling (Gemma 3 4B and up: `rope.scaling.type` / `.factor`; the
    local layers keep none), the attention scale (llama.cpp: 1/sqrt(hidden / heads) for the 27B model,
    else 1/sqrt(head_dim); transformers would take its default of 256 for every size), and a final
    logit soft-cap where the file sets one. The layer pattern (every sixth layer global) and the
    local rope base (10000) are both readers' defaults, so `config` (transformers' reading) has them."""
    out: dict[str, Any] = {}
    scaling = meta.arch_value("rope.scaling.type")
    if scaling == "linear":
        factor = float(meta.arch_value("rope.scaling.factor"))
        rope = dict(config.rope_parameters)
        rope[FULL] = {**rope[FULL], "rope_type": "linear", "factor": factor}
        out["rope_parameters"] = rope
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"gemma3 GGUF: unsupported rope scaling {scaling!r} (expected linear)")
    if config.num_hidden_layers == GEMMA3_27B_LAYERS:
        out["query_pre_attn_scalar"] = config.hidden_size // config.num_attention_heads
    else:
        out["query_pre_attn_scalar"] = config.head_dim
    cap = meta.arch_value("final_logit_softcapping")
    if cap:
        out["final_logit_softcapping"] = float(cap)
    return out


FAMILY = ModelFamily(
    name="gemma3",
    # A multimodal checkpoint's language model too (its vision tower is skipped while loading).
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    model=Gemma3ForCausalLM,
    weights=GEMMA3_WEIGHT_NAMES,
    gguf=GGUFSupport(
        architectures=("gemma3",),
        norm_offset=-1.0,
        config=gemma3_gguf_config,
    ),
    native_decode=gemma3_decode_parts,
    sliding_window=config_sliding_window,
)
