"""What a model family declares (one file each under models/families/, listed in models/registry.py).

A family is its model class plus data the shared code reads: how checkpoint tensor names map onto the
class's (fused, sharded) parameters (`WeightNames`, read by models/weight_names.py), which GGUF
architectures are read in place (`GGUFSupport`, read by models/gguf/), which abilities it opts into
(the native fused decode layout, weight packing, tensor parallelism) and which sliding window its
config turns on. Nothing outside a family's own file branches on `model_type` or a GGUF architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from models.layers.native_decode import DecodeLayerParts

# Which part of a fused parameter a checkpoint tensor fills: "q"/"k"/"v" of a QKV projection, the
# index of a merged column-parallel linear's part, or None for a whole parameter.
ShardId = str | int | None


@dataclass(frozen=True)
class WeightNames:
    """How a checkpoint's tensor names become this family's parameter names (HF names; a GGUF file's
    tensors arrive under the HF names transformers gives them)."""

    # Prefix of decoder layer i's parameters ("model.layers." -> "model.layers.7.mlp.up_proj.weight").
    layers: str
    # Parameter-name prefixes only the first / last pipeline stage holds (embeddings / final norm, head).
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    # The token embedding's weight: a tied LM head on a later pipeline stage loads its own copy of it.
    embedding: str
    head: str = "lm_head.weight"
    # Separate checkpoint tensors fused into one parameter here: (checkpoint fragment, our fragment,
    # shard id), e.g. (".q_proj.", ".qkv_proj.", "q").
    stacked: tuple[tuple[str, str, ShardId], ...] = ()
    # Fused checkpoint tensors cut along their rows into the shards of one parameter here, sized by
    # the parameter's layer (`shard_sizes()`), e.g. (".c_attn.", ("q", "k", "v")).
    split: tuple[tuple[str, tuple[ShardId, ...]], ...] = ()
    # Suffixes of weights stored [in, out] (GPT-2's Conv1D), transposed to [out, in].
    transposed: tuple[str, ...] = ()
    # Suffixes of checkpoint buffers recomputed here (rotary tables, causal masks).
    ignored: tuple[str, ...] = ()
    # Prepended to names that lack it (checkpoints saved from the bare model, without its wrapper).
    prefix: str = ""


class GGUFMetadata(Protocol):
    """What a family's GGUF config function reads of a file (models/gguf/metadata.py reads it)."""

    architecture: str  # general.architecture

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value by its full key ("tokenizer.ggml.eos_token_id")."""

    def arch_value(self, name: str, default: Any = None) -> Any:
        """A value under the architecture's prefix ("attention.key_length" -> "qwen3.attention.key_length")."""

    def tensor(self, name: str) -> Any:
        """A small tensor's values (float32 numpy array; rope factors), or None if the file has none."""


@dataclass(frozen=True)
class GGUFSupport:
    """GGUF architectures (`general.architecture`) whose tensors transformers' GGUF loader only renames,
    so their raw quantized blocks are read in place (models/gguf/reader.py); any other architecture
    transformers reads is converted to float safetensors once instead."""

    architectures: tuple[str, ...]
    # llama.cpp's converter interleaves the rotary halves of q/k rows for these (transformers undoes it).
    permute_qk: bool = False
    # Config entries the file states but transformers' GGUF reader leaves out (a head_dim apart from
    # hidden / heads, partial rotary, rope scaling, the window): set on the converted config.
    config: Callable[[GGUFMetadata], dict[str, Any]] | None = None


def no_sliding_window(config: Any) -> int | None:
    return None


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its class and what the shared loader, converter and kernels read of it."""

    name: str
    # HF `architectures[0]` values this family serves.
    architectures: tuple[str, ...]
    model: type[nn.Module]  # a models.base.CausalLMBase
    weights: WeightNames
    gguf: GGUFSupport | None = None
    # The layout of one decoder layer for decode steps in one native call (models/layers/native_decode.py);
    # None: the modules always run.
    native_decode: Callable[[nn.Module], DecodeLayerParts | None] | None = None
    # Whether block-quantized weights may stay packed for the native CPU kernels.
    packing: bool = True
    # Whether the layers shard Megatron-style (column-parallel in, row-parallel out, vocab-parallel
    # embedding and head); every layer class that does takes a TPContext.
    tensor_parallel: bool = True
    # The attention window the config turns on (None: full attention); the context is capped at it
    # until sliding-window attention lands.
    sliding_window: Callable[[Any], int | None] = field(default=no_sliding_window)

    def __post_init__(self) -> None:
        # The class learns its family, so a built model reads its own declaration (model.family).
        self.model.family = self
