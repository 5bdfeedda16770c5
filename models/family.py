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

from models.errors import ModelLoadError

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
    # Checkpoint name prefixes replaced before anything else is read of a name (a multimodal
    # checkpoint's language model under its own prefix: ("language_model.model.", "model.")); a
    # prefix replaced by None marks tensors this server does not use (a vision tower), skipped.
    renamed: tuple[tuple[str, str | None], ...] = ()
    # Name fragments replaced wherever they occur, before stacking (Mixtral's ".block_sparse_moe." ->
    # ".mlp.", ".w2." -> ".down_proj.").
    replaced: tuple[tuple[str, str], ...] = ()
    # A mixture of experts' stacked tensors [experts, rows, cols] (transformers 5's fused parameters,
    # a GGUF file's ffn_*_exps), unstacked into one tensor per expert: (name suffix, per-expert
    # suffix with {} for the expert's index), e.g. (".experts.down_proj", ".experts.{}.down_proj.weight").
    experts: tuple[tuple[str, str], ...] = ()


class GGUFMetadata(Protocol):
    """What a family's GGUF config function reads of a file (models/gguf/metadata.py reads it)."""

    architecture: str  # general.architecture

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value by its full key ("tokenizer.ggml.eos_token_id")."""

    def arch_value(self, name: str, default: Any = None) -> Any:
        """A value under the architecture's prefix ("attention.key_length" -> "qwen3.attention.key_length")."""

    def tensor(self, name: str) -> Any:
        """A small tensor's values (float32 numpy array; rope factors), or None if the file has none."""

    def has_tensor(self, name: str) -> bool:
        """Whether the file has a tensor of that name (any size; nothing is read)."""


@dataclass(frozen=True)
class GGUFSupport:
    """GGUF architectures (`general.architecture`) whose tensors transformers' GGUF loader only renames,
    so their raw quantized blocks are read in place (models/gguf/reader.py); any other architecture
    transformers reads is converted to float safetensors once instead."""

    architectures: tuple[str, ...]
    # llama.cpp's converter interleaves the rotary halves of q/k rows for these (transformers undoes it).
    permute_qk: bool = False
    # Added to every `*norm.weight` tensor as it is read: llama.cpp stores Gemma's (1 + w) norms as
    # w + 1, and transformers' GGUF loader subtracts the 1 again (-1.0 here does the same).
    norm_offset: float = 0.0
    # Config entries the file states but transformers' GGUF reader leaves out (a head_dim apart from
    # hidden / heads, partial rotary, rope scaling, the window, Gemma 3's attention scale): from the
    # file's metadata and the config transformers read (not changed: the entries returned are set on
    # the converted config), as llama.cpp reads them.
    config: Callable[[GGUFMetadata, Any], dict[str, Any]] | None = None
    # Tensors of a block named here rather than by transformers' mapping: (name within block i,
    # "ffn_gate_exps.weight", -> parameter name within layer i, "mlp.experts.gate_proj"). The expert
    # stacks: transformers merges ffn_gate_exps and ffn_up_exps into one parameter, which a
    # manifest could not tell apart; here each stays its own tensor, cut into one weight per expert.
    block_tensors: tuple[tuple[str, str], ...] = ()
    # transformers' model type of a file whose metadata makes it another model than transformers'
    # reader takes it for (a `llama` file with experts is a Mixtral), or None: as read.
    model_type: Callable[[GGUFMetadata], str | None] | None = None
    # The whole config from the metadata (with its "model_type"), for an architecture transformers'
    # GGUF reader does not read at all (olmoe); its tokenizer is then transformers' reading of the
    # file's tokenizer metadata alone (PreTrainedTokenizerFast), which needs no architecture.
    metadata_config: Callable[[GGUFMetadata], dict[str, Any]] | None = None


def no_sliding_window(config: Any) -> int | None:
    return None


def config_sliding_window(config: Any) -> int | None:
    """The config's `sliding_window`, in force wherever it is set (Mistral, Phi-3, Gemma 3's local layers)."""
    return getattr(config, "sliding_window", None) or None


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal config's text part (transformers' `get_text_config`:
    Gemma 3's `text_config`), otherwise the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


# transformers' `layer_types` entries this server runs (any other is refused).
SLIDING, FULL = "sliding_attention", "full_attention"


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
    # The attention window the (text) config turns on (None: full attention); `layer_windows` says
    # which layers use it.
    sliding_window: Callable[[Any], int | None] = field(default=no_sliding_window)

    def __post_init__(self) -> None:
        # The class learns its family, so a built model reads its own declaration (model.family).
        self.model.family = self

    def layer_windows(self, config: Any) -> tuple[int | None, ...]:
        """Each decoder layer's sliding window (None: full attention), as transformers applies it: the
        window on the layers the config's `layer_types` marks sliding (Qwen2's past
        `max_window_layers`, Gemma 3's local layers), on every layer where it lists no types
        (Mistral)."""
        text = text_config(config)
        n = text.num_hidden_layers
        window = self.sliding_window(text)
        types = getattr(text, "layer_types", None)
        if types is not None:
            if len(types) != n or not set(types) <= {SLIDING, FULL}:
                raise ModelLoadError(
                    f"layer_types {types!r}: expected {n} entries of {SLIDING!r} or {FULL!r}"
                )
            if window is None and SLIDING in types:
                raise ModelLoadError("layer_types has sliding-attention layers but the config sets no window")
        if window is None:
            return (None,) * n
        if types is None:
            return (int(window),) * n
        return tuple(int(window) if t == SLIDING else None for t in types)

    def shared_window(self, config: Any) -> int | None:
        """The sliding window every layer has (Mistral's configs), or None where some layer attends to
        the whole history (Gemma 3's global layers, Qwen2's below max_window_layers, no window at all):
        a request's KV blocks behind it are never read again (Executor.kv_window)."""
        windows = set(self.layer_windows(config))
        return windows.pop() if len(windows) == 1 and None not in windows else None
