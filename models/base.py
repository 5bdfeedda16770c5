"""What every causal-LM class shares: the engine-facing attributes, backend choice, logits, and the
weight-loading loop (HF names -> our, possibly fused and sharded, parameters)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from models.errors import MissingWeightsError, ModelLoadError
from models.layers.attention import AttentionStep, select_attention_backend
from models.layers.attention_backends import AttentionBackend
from models.layers.linear import MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear
from models.layers.metadata import AttentionMetadata

# (HF name it came from, our parameter name, full tensor, shard id or None)
WeightItem = tuple[str, str, torch.Tensor, Any]


class CausalLMBase(nn.Module):
    """Subclasses set: config, num_layers, num_kv_heads (per TP rank), head_dim, vocab_size, lm_head."""

    config: Any
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    lm_head: ParallelLMHead

    def __init__(self) -> None:
        super().__init__()
        self.attn_backend: AttentionBackend | None = None

    def set_attention_backend(
        self, backend: str | AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        """Override the automatic choice ("auto", "sdpa", "cpu-decode", "torch-varlen", "flash-attn")."""
        self.attn_backend = select_attention_backend(backend, device) if isinstance(backend, str) else backend

    def begin_step(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata) -> AttentionStep:
        if self.attn_backend is None:
            self.attn_backend = select_attention_backend("auto", input_ids.device)
        return AttentionStep.begin(self.attn_backend, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, vocab] float32."""
        return self.lm_head(hidden).float()

    def load_mapped_weights(self, items: Iterable[WeightItem]) -> None:
        """Copy every item into its parameter (through the parameter's sharding-aware loader) and fail
        with one clear error on an unknown, mis-shaped or missing weight."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for hf_name, name, tensor, shard in items:
            param = params.get(name)
            if param is None:
                raise ModelLoadError(
                    f"unexpected weight {hf_name!r}: this {type(self).__name__} has no such parameter"
                )
            try:
                param.weight_loader(param, tensor, shard)
            except ValueError as e:
                raise ModelLoadError(f"weight {hf_name!r} {e}") from None
            loaded.add((name, shard))
        missing = [
            f"{name}{'' if shard is None else f'[{shard}]'}" for name, shard in self._expected() - loaded
        ]
        if missing:
            shown = ", ".join(sorted(missing)[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise MissingWeightsError(f"missing weights for {type(self).__name__}: {shown}{more}")

    def _expected(self) -> set[tuple[str, Any]]:
        """Every (parameter, shard) that a complete checkpoint fills in."""
        expected = set()
        for name, _ in self.named_parameters():  # tied parameters are listed once
            module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            if isinstance(module, QKVParallelLinear) and name.endswith(("weight", "bias")):
                expected |= {(name, s) for s in ("q", "k", "v")}
            elif isinstance(module, MergedColumnParallelLinear):
                expected |= {(name, s) for s in range(len(module.output_sizes))}
            else:
                expected.add((name, None))
        return expected
