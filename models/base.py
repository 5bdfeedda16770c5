"""What every causal-LM class shares: the engine-facing attributes, backend choice, logits, and the
weight-loading loop (HF names -> our, possibly fused and sharded, parameters)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from models.errors import MissingWeightsError, ModelLoadError
from models.family import ModelFamily
from models.layers.attention import AttentionStep, select_attention_backend
from models.layers.attention_backends import AttentionBackend
from models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from models.layers.metadata import AttentionMetadata
from models.layers.native_decode import NativeDecodeLayers
from models.layers.parallel import PPContext, TPContext
from models.weight_names import WeightItem, absent_prefixes, map_weight_names


class PPMissingLayer(nn.Identity):
    """Stands in for a decoder layer held by another pipeline stage: keeps the global layer indices
    (and so the checkpoint's parameter names) of the layers this stage does hold."""


def stage_layers(num_layers: int, pp: PPContext, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All layer slots, built only for this stage's range (the others are PPMissingLayer)."""
    owned = pp.layer_range(num_layers)
    return nn.ModuleList(build(i) if i in owned else PPMissingLayer() for i in range(num_layers))


class CausalLMBase(nn.Module):
    """Subclasses set: config, tp, pp, stage_layers (the global indices this pipeline stage holds),
    num_layers (their count), num_kv_heads (per TP rank), head_dim, hidden_size, vocab_size,
    tie_word_embeddings, lm_head (None except on the last pipeline stage), and implement
    `decoder_layers()`. Their family (models/family.py) declares the rest."""

    family: ClassVar[ModelFamily]  # set by the family's declaration (ModelFamily.__post_init__)
    config: Any
    tp: TPContext
    pp: PPContext
    stage_layers: range
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    lm_head: ParallelLMHead | None

    def __init__(self) -> None:
        super().__init__()
        self.attn_backend: AttentionBackend | None = None
        # Decode steps' layers in one native call (prepare_native_decode); None: the modules run them.
        self.native_decode: NativeDecodeLayers | None = None

    def decoder_layers(self) -> list[nn.Module]:
        """This pipeline stage's decoder layers, in order."""
        raise NotImplementedError

    @property
    def absent_prefixes(self) -> tuple[str, ...]:
        """Parameter-name prefixes of the modules other pipeline stages hold (their weights are skipped)."""
        return absent_prefixes(self.family.weights, self.config.num_hidden_layers, self.pp)

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
        """Set `native_decode` where the family declares a native decode layout and this stage's layers
        fit it (models/layers/native_decode.py); called once the weights are packed."""
        parts_of = self.family.native_decode
        if parts_of is not None:
            self.native_decode = NativeDecodeLayers.build(
                [parts_of(x) for x in self.decoder_layers()], self.tp.size
            )

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

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load a checkpoint's (name, tensor) pairs, named as the family declares (models/weight_names.py)."""
        names = self.family.weights
        self.load_mapped_weights(map_weight_names(names, self, self.tie_word_embeddings, self.pp, weights))

    def load_mapped_weights(self, items: Iterable[WeightItem]) -> None:
        """Copy every item into its parameter (through the parameter's sharding-aware loader) and fail
        with one clear error on an unknown, mis-shaped or missing weight."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        absent = self.absent_prefixes
        for hf_name, name, tensor, shard in items:
            if absent and name.startswith(absent):
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
            shard_sizes = getattr(module, "shard_sizes", None)  # a fused parameter is loaded by parts
            if shard_sizes is not None and name.endswith(("weight", "bias")):
                expected |= {(name, s) for s in shard_sizes()}
            else:
                expected.add((name, None))
        return expected
