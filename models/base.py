"""What every causal-LM class shares: the engine-facing attributes, backend choice, logits, and the
weight-loading loop (HF names -> our, possibly fused and sharded, parameters)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from models.errors import MissingWeightsError, ModelLoadError
from models.family import ModelFamily, text_config
from models.layers.attention import Attention, AttentionSplitter, AttentionStep, select_attention_backend
from models.layers.attention_backends import AttentionBackend
from models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from models.layers.metadata import AttentionMetadata, KVCache
from models.layers.native_decode import NativeDecodeLayers
from models.layers.parallel import SINGLE, SINGLE_STAGE, PPContext, TPContext
from models.layers.rotary import RotaryEmbedding
from models.weight_names import WeightItem, absent_prefixes, map_weight_names


@runtime_checkable
class CaptureAware(Protocol):
    """A layer that may decide on the host what a step runs (a mixture of experts' module loop), which
    a CUDA graph cannot capture."""

    def capture_blocker(self, device: torch.device) -> str | None:
        """Why its steps cannot be captured on `device` (None: they can)."""
        ...


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer, its attention and its MLP are built from."""

    config: Any  # the language model's config
    rotary: RotaryEmbedding | None  # the cos/sin table its kind of layer shares
    dtype: torch.dtype
    tp: TPContext
    window: int | None = None  # its sliding window (None: full attention)


class PPMissingLayer(nn.Identity):
    """Stands in for a decoder layer held by another pipeline stage: keeps the global layer indices
    (and so the checkpoint's parameter names) of the layers this stage does hold."""


def stage_layers(num_layers: int, pp: PPContext, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All layer slots, built only for this stage's range (the others are PPMissingLayer)."""
    owned = pp.layer_range(num_layers)
    return nn.ModuleList(build(i) if i in owned else PPMissingLayer() for i in range(num_layers))


class CausalLMBase(nn.Module):
    """What every family's model class shares: the engine-facing sizes, the attention backend, the
    forward pass over a step's flat tokens, logits and weight loading.

    Every family's class is built as `cls(config, dtype, tp, pp)`; it writes `build`, which makes its
    modules (the embedding on the first pipeline stage, this stage's layers, the final norm and
    `lm_head` on the last) and calls `set_sizes`, and supplies `embed`, `all_layers` and `final_norm`.
    Every decoder layer is called as `layer(positions, hidden, kv_cache, step)`. Its family
    (models/family.py) declares the rest: weight names, GGUF support, the native decode layout."""

    family: ClassVar[ModelFamily]  # set by the family's declaration (ModelFamily.__post_init__)
    num_kv_heads: int  # this tensor rank's
    head_dim: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    lm_head: ParallelLMHead | None
    # The size of the files the weights were read from (set by the loader; None: random weights).
    weight_file_bytes: int | None = None

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
        pp: PPContext = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        self.config = config  # as given: a multimodal config's language model is its text_config
        self.tp = tp
        self.pp = pp
        text = text_config(config)
        self.stage_layers = pp.layer_range(text.num_hidden_layers)  # the global indices this stage holds
        self.num_layers = len(self.stage_layers)  # this stage's: one KV cache per layer held here
        self.attn_backend: AttentionBackend | None = None
        # Decode steps' layers in one native call (prepare_native_decode); None: the modules run them.
        self.native_decode: NativeDecodeLayers | None = None
        # Set only while engine/piecewise_graphs.py captures (or stands in for) a forward in pieces.
        self.attention_splitter: AttentionSplitter | None = None
        self.build(text, dtype)

    def set_sizes(self, hidden_size: int, vocab_size: int, attention: Attention) -> None:
        """The sizes the engine reads off the model (the KV cache's shape is this stage's first layer's
        attention op's: this rank's KV heads and their head_dim)."""
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim

    # ---- what a family supplies -------------------------------------------------------------------

    def build(self, config: Any, dtype: torch.dtype) -> None:
        """This stage's modules for `config` (the language model's config); ends with set_sizes."""
        raise NotImplementedError

    # The defaults read the usual layout, a body `self.model` with `embed_tokens`, `layers` and `norm`
    # (Llama's and most families'); a family laid out otherwise (GPT-2) overrides them.

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the first pipeline stage's input."""
        return self.model.embed_tokens(input_ids)

    def all_layers(self) -> nn.ModuleList:
        """Every decoder layer slot (other stages' as PPMissingLayer)."""
        return self.model.layers

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's norm before the LM head."""
        return self.model.norm(hidden)

    # ---- shared ---------------------------------------------------------------------------------

    def decoder_layers(self) -> list[nn.Module]:
        """This pipeline stage's decoder layers, in order."""
        return list(self.all_layers()[self.stage_layers.start : self.stage_layers.stop])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # this stage's layers only
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,  # [T, hidden]: the previous stage's output
    ) -> torch.Tensor:  # [T, hidden]: normed on the last stage, the raw residual stream on the others
        step = self.begin_step(input_ids, attn_metadata)
        embedded = self.embed(input_ids, positions) if self.pp.is_first else None
        hidden = self.stage_input(embedded, hidden_states)  # [T, hidden]
        # (Not while split into pieces: the native call runs the layers' attentions itself.)
        native = (
            self.native_decode.forward(positions, hidden, kv_caches, step)
            if self.native_decode and step.splitter is None
            else None
        )
        if native is not None:
            hidden = native
        else:
            for layer, kv_cache in zip(self.decoder_layers(), kv_caches, strict=True):
                hidden = layer(positions, hidden, kv_cache, step)
        return self.final_norm(hidden) if self.pp.is_last else hidden

    @property
    def absent_prefixes(self) -> tuple[str, ...]:
        """Parameter-name prefixes of the modules other pipeline stages hold (their weights are skipped)."""
        return absent_prefixes(self.family.weights, text_config(self.config).num_hidden_layers, self.pp)

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
        head = ParallelLMHead(text_config(self.config).vocab_size, hidden_size, dtype=dtype, tp=tp)
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

    def capture_blocker(self, device: torch.device) -> str | None:
        """Why CUDA graphs cannot capture this model's decode steps on `device` (None: they can), as its
        first layer that cannot be captured says."""
        for module in self.modules():
            if isinstance(module, CaptureAware) and module is not self:
                why = module.capture_blocker(device)
                if why is not None:
                    return why
        return None

    def set_attention_backend(
        self, backend: str | AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        """Override the automatic choice ("auto", "sdpa", "cpu-decode", "torch-varlen", "flash-attn").
        A model with sliding-window layers refuses a backend that cannot run windows (auto picks sdpa
        instead of one)."""
        chosen = select_attention_backend(backend, device) if isinstance(backend, str) else backend
        if not chosen.supports_sliding_window and any(self.family.layer_windows(self.config)):
            if backend != "auto":
                raise ValueError(
                    f"attention backend {chosen.name!r} cannot run sliding-window attention, which this "
                    "model's layers use; choose another backend"
                )
            chosen = select_attention_backend("sdpa", device)
        self.attn_backend = chosen

    def begin_step(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata) -> AttentionStep:
        if self.attn_backend is None:
            self.set_attention_backend("auto", input_ids.device)
        return AttentionStep.begin(self.attn_backend, attn_metadata, self.attention_splitter)

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
