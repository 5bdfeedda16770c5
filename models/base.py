"""What every causal-LM class shares: the engine-facing attributes, backend choice, logits, and the
weight-loading loop (HF names -> our, possibly fused and sharded, parameters)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from models.errors import MissingWeightsError, ModelLoadError
from models.layers.attention import AttentionStep, select_attention_backend
from models.layers.attention_backends import AttentionBackend
from models.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    VocabParallelEmbedding,
)
from models.layers.metadata import AttentionMetadata
from models.layers.native_decode import NativeDecodeLayers
from models.layers.parallel import PPContext, TPContext

# (HF name it came from, our parameter name, full tensor, shard id or None)
WeightItem = tuple[str, str, torch.Tensor, Any]


class PPMissingLayer(nn.Identity):
    """Stands in for a decoder layer held by another pipeline stage: keeps the global layer indices
    (and so the checkpoint's parameter names) of the layers this stage does hold."""


def stage_layers(num_layers: int, pp: PPContext, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All layer slots, built only for this stage's range (the others are PPMissingLayer)."""
    owned = pp.layer_range(num_layers)
    return nn.ModuleList(build(i) if i in owned else PPMissingLayer() for i in range(num_layers))


def absent_layer_prefixes(prefix: str, num_layers: int, pp: PPContext) -> tuple[str, ...]:
    """Parameter-name prefixes ("model.layers.7.") of the layers other stages hold."""
    owned = pp.layer_range(num_layers)
    return tuple(f"{prefix}{i}." for i in range(num_layers) if i not in owned)


class CausalLMBase(nn.Module):
    """Subclasses set: config, num_layers (held by this pipeline stage), num_kv_heads (per TP rank),
    head_dim, vocab_size, lm_head (None except on the last pipeline stage), and absent_prefixes (the
    parameter-name prefixes of modules another pipeline stage holds: their weights are skipped)."""

    config: Any
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    lm_head: ParallelLMHead | None

    def __init__(self) -> None:
        super().__init__()
        self.attn_backend: AttentionBackend | None = None
        # Decode steps' layers in one native call (prepare_native_decode); None: the modules run them.
        self.native_decode: NativeDecodeLayers | None = None
        self.absent_prefixes: tuple[str, ...] = ()

    def build_lm_head(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        tp: TPContext,
        pp: PPContext,
        tie_to: VocabParallelEmbedding | None,
    ) -> ParallelLMHead | None:
        """The LM head, on the last pipeline stage only; shares `tie_to`'s weight when given (a tied
        head on a stage without the embedding loads its own copy instead)."""
        if not pp.is_last:
            return None
        head = ParallelLMHead(self.config.vocab_size, hidden_size, dtype=dtype, tp=tp)
        if tie_to is not None:
            head.tie_to(tie_to)
        return head

    @staticmethod
    def stage_input(embedded: torch.Tensor | None, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The first stage embeds its tokens; every later stage continues the previous one's output."""
        if embedded is not None:
            return embedded
        if hidden_states is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's hidden_states")
        return hidden_states

    def prepare_native_decode(self) -> None:
        """Set `native_decode` where this model's layers fit a native whole-stack decode call
        (models/layers/native_decode.py); called once the weights are packed."""

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
        """[B, hidden] -> [B, vocab] float32 (last pipeline stage only)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        return self.lm_head(hidden).float()

    def load_mapped_weights(self, items: Iterable[WeightItem]) -> None:
        """Copy every item into its parameter (through the parameter's sharding-aware loader) and fail
        with one clear error on an unknown, mis-shaped or missing weight."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for hf_name, name, tensor, shard in items:
            if self.absent_prefixes and name.startswith(self.absent_prefixes):
                continue  # held by another pipeline stage
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
