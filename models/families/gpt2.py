"""GPT-2 (the architecture family of the GPT-3 models in the ORCA paper) for selective batching.

LayerNorm, tanh-approximated GELU, learned position embeddings, tied LM head. HF checkpoints store the
projections as Conv1D weights [in, out]; they are transposed to nn.Linear's [out, in] while loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from models.base import CausalLMBase, stage_layers
from models.family import ModelFamily, WeightNames
from models.layers.activation import get_gelu
from models.layers.attention import Attention, AttentionStep
from models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from models.layers.metadata import KVCache
from models.layers.norm import LayerNorm
from models.layers.parallel import SINGLE_STAGE, PPContext, TPContext

GPT2_WEIGHT_NAMES = WeightNames(
    layers="transformer.h.",
    first_stage=("transformer.wte.", "transformer.wpe."),
    last_stage=("transformer.ln_f.",),
    embedding="transformer.wte.weight",
    # HF stores the projections as Conv1D weights [in, out]; c_attn holds q, k and v in one tensor.
    transposed=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight"),
    split=((".c_attn.", ("q", "k", "v")),),
    # Causal-mask buffers of old checkpoints; the attention op does its own masking.
    ignored=(".attn.bias", ".attn.masked_bias"),
    # Some GPT-2 checkpoints (the original "gpt2") have no "transformer." prefix.
    prefix="transformer.",
)


class PositionEmbedding(nn.Module):
    """Learned absolute positions, replicated on every rank (small next to the vocabulary)."""

    def __init__(self, num_positions: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


class GPT2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype, tp: TPContext):
        super().__init__()
        hidden, heads = config.n_embd, config.n_head
        head_dim = hidden // heads
        self.c_attn = QKVParallelLinear(hidden, head_dim, heads, heads, True, dtype, tp)
        self.c_proj = RowParallelLinear(hidden, hidden, True, dtype, tp, input_shard=self.c_attn.q_shard)
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.num_heads = self.c_attn.num_heads
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, head_dim, self.num_heads, scale)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, step: AttentionStep) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.c_attn(x).view(t, 3 * self.num_heads, self.head_dim)  # [T, 3H, D]
        q, k, v = qkv.split(self.num_heads, dim=1)  # [T, H, D] each
        return self.c_proj(self.attn(q, k, v, kv_cache, step))


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, tp: TPContext):
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, True, dtype, tp)
        self.act = get_gelu(config.activation_function)
        self.c_proj = RowParallelLinear(inner, config.n_embd, True, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype, tp: TPContext):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.n_embd, eps, dtype)
        self.attn = GPT2Attention(config, layer_idx, dtype, tp)
        self.ln_2 = LayerNorm(config.n_embd, eps, dtype)
        self.mlp = GPT2MLP(config, dtype, tp)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, step: AttentionStep
    ) -> torch.Tensor:  # positions: the learned ones were added at the embedding
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, step)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """Token and position embeddings on the first pipeline stage, this stage's blocks, ln_f on the last."""

    def __init__(
        self, config: PretrainedConfig, dtype: torch.dtype, tp: TPContext, pp: PPContext = SINGLE_STAGE
    ):
        super().__init__()
        first, last = pp.is_first, pp.is_last
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, dtype, tp) if first else None
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd, dtype) if first else None
        self.h = stage_layers(config.n_layer, pp, lambda i: GPT2Block(config, i, dtype, tp))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon, dtype) if last else None


class GPT2LMHeadModel(CausalLMBase):
    def build(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        tp, pp = self.tp, self.pp
        self.transformer = GPT2Model(config, dtype, tp, pp)
        # GPT-2 always ties its head to the token embedding (a last stage without the embedding loads
        # its own copy of wte into the head).
        self.lm_head = self.build_lm_head(config.n_embd, dtype, tp, pp, tie_to=self.transformer.wte)
        self.tie_word_embeddings = True
        first = self.transformer.h[self.stage_layers.start]
        self.set_sizes(config.n_embd, config.vocab_size, first.attn.attn)  # no GQA: a KV head per head

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids) + self.transformer.wpe(positions)

    def all_layers(self) -> nn.ModuleList:
        return self.transformer.h

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(hidden)


# GPT-2 GGUF files are converted to float safetensors by transformers (its tensors are transposed and
# fused differently), so no GGUFSupport; no native decode layout (LayerNorm, GELU, biases everywhere).
FAMILY = ModelFamily(
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    model=GPT2LMHeadModel,
    weights=GPT2_WEIGHT_NAMES,
)
