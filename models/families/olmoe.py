"""OLMoE (OLMoE-1B-7B): Llama's layers with an RMSNorm over the WHOLE q and k projections (weights
[heads * head_dim] and [kv_heads * head_dim], unlike Qwen3's per-head norms), optional clipping of
q, k and v (`clip_qkv`), and a mixture of experts in place of every MLP: softmax over `num_experts`,
the top `num_experts_per_tok`, renormalised where `norm_topk_prob` (not in the published model),
each expert `intermediate_size` wide."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from models.base import LayerSpec
from models.families.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaLayout,
    expert_gguf,
    llama_decode_parts,
    moe_family,
    sparse_mlp,
)
from models.family import GGUFMetadata
from models.kernels import cpu as cpu_kernels
from models.layers.attention import AttentionStep
from models.layers.metadata import KVCache
from models.layers.moe import Routing, check_routing
from models.layers.native_decode import DecodeLayerParts
from models.layers.parallel import TPContext


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose heads are split across tensor-parallel ranks: each rank
    holds its heads' slice of the weight, and the sum of squares is all-reduced, over `reduced_width`
    values in all (the full width; times the replicas where KV heads are replicated, whose sum of
    squares every replica adds)."""

    def __init__(
        self,
        full_width: int,
        start: int,
        width: int,
        reduced_width: int,
        eps: float,
        dtype: torch.dtype,
        tp: TPContext,
    ) -> None:
        super().__init__()
        self.full_width, self.start, self.reduced_width = full_width, start, reduced_width
        self.eps = eps
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: object) -> None:
        if tuple(loaded.shape) != (self.full_width,):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected ({self.full_width},)")
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1 and x.dim() == 2:
            # One process holds the whole projection: the native norm, the one the fused decode
            # layers run on it (a token's q and k do not depend on which of the two ran its step).
            rows = x.contiguous()  # a slice of the fused qkv
            if cpu_kernels.fits_rowwise(rows, rows.shape[-1]):
                return cpu_kernels.rms_norm(rows, self.weight, self.eps)
        xf = x.float()
        sum_sq = self.tp.all_reduce(xf.pow(2).sum(dim=-1, keepdim=True))
        normed = xf * torch.rsqrt(sum_sq / self.reduced_width + self.eps)
        return self.weight * normed.to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, spec: LayerSpec, layout: LlamaLayout):
        super().__init__(spec, layout)
        config, qkv, d = spec.config, self.qkv_proj, layout.head_dim
        eps, dtype, tp = config.rms_norm_eps, spec.dtype, spec.tp
        self.q_norm = ProjectionRMSNorm(
            qkv.total_num_heads * d, qkv.q_start * d, qkv.q_size, qkv.total_num_heads * d, eps, dtype, tp
        )
        kv_full = qkv.total_num_kv_heads * d
        self.k_norm = ProjectionRMSNorm(
            kv_full, qkv.kv_start * d, qkv.kv_size, kv_full * qkv.kv_replicas, eps, dtype, tp
        )
        self.clip = getattr(config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, step: AttentionStep):
        q, k, v = self.qkv_proj(x).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1
        )
        qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip is not None:
            qkv.clamp_(min=-self.clip, max=self.clip)
        return self.o_proj(self.attn.forward_rotary_qkv(qkv, positions, self.rotary, kv_cache, step))


def olmoe_gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """An `olmoe` file's config, as llama.cpp reads it (transformers' GGUF reader has none): its
    sizes, the experts (llama.cpp's olmoe does not renormalise the top k, as OLMoE-1B-7B), clipping
    (attention.clamp_kqv), the special tokens, and a head tied where the file has no output.weight."""
    value = meta.arch_value
    tokens = meta.value("tokenizer.ggml.tokens") or []
    clip = value("attention.clamp_kqv")
    return {
        "model_type": "olmoe",
        "vocab_size": int(value("vocab_size") or len(tokens)),
        "hidden_size": int(value("embedding_length")),
        "intermediate_size": int(value("expert_feed_forward_length") or value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": int(value("attention.head_count")),
        "num_key_value_heads": int(value("attention.head_count_kv") or value("attention.head_count")),
        "max_position_embeddings": int(value("context_length")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-5)),
        "num_experts": int(value("expert_count")),
        "num_experts_per_tok": int(value("expert_used_count")),
        "norm_topk_prob": False,
        "clip_qkv": float(clip) if clip else None,
        "bos_token_id": meta.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.value("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.value("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": not meta.has_tensor("output.weight"),
    }


def olmoe_mlp(spec: LayerSpec, layout: LlamaLayout, index: int) -> nn.Module:
    config = spec.config
    check_routing(config, "OLMoE")
    routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
    return sparse_mlp(spec, config.intermediate_size, routing)


def olmoe_decode_parts(layer: nn.Module) -> DecodeLayerParts:
    """Llama's layer with the norms over the whole q and k projections and the clipping before
    rotary, and the experts as its MLP."""
    attn = layer.self_attn
    parts = llama_decode_parts(layer)  # which takes attn's q_norm / k_norm for per-head ones
    return replace(
        parts, q_norm=None, k_norm=None, q_proj_norm=attn.q_norm, k_proj_norm=attn.k_norm, clip=attn.clip
    )


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_mlp = staticmethod(olmoe_mlp)
    layer_attention = OlmoeAttention


FAMILY = moe_family(
    "olmoe",
    OlmoeForCausalLM,
    # llama.cpp turns OLMoE's q/k halves as transformers does (NeoX order): nothing to un-permute.
    gguf=expert_gguf(("olmoe",), metadata_config=olmoe_gguf_config),
    native_decode=olmoe_decode_parts,
)
