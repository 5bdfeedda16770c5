"""Checkpoint tensor names -> this model's parameters, from the family's `WeightNames` declaration.

    for hf_name, name, tensor, shard in map_weight_names(model, weights): ...

The one place that knows about fused parameters (q/k/v, gate/up), fused checkpoint tensors cut into
shards, stacked expert tensors cut into experts, transposed Conv1D weights, recomputed buffers, tied
heads and pipeline stages; the families only declare their names (models/family.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from models.errors import ModelLoadError
from models.family import ShardId, WeightNames
from models.layers.parallel import PPContext

# (checkpoint name it came from, our parameter name, tensor, shard id or None)
WeightItem = tuple[str, str, Any, ShardId]


def absent_prefixes(names: WeightNames, num_layers: int, pp: PPContext) -> tuple[str, ...]:
    """Parameter-name prefixes of what other pipeline stages hold (their weights are skipped)."""
    owned = pp.layer_range(num_layers)
    prefixes = tuple(f"{names.layers}{i}." for i in range(num_layers) if i not in owned)
    if not pp.is_first:
        prefixes += names.first_stage
    if not pp.is_last:
        prefixes += names.last_stage
    return prefixes


def map_weight_names(
    names: WeightNames, model: nn.Module, tied: bool, pp: PPContext, weights: Iterable[tuple[str, Any]]
) -> Iterator[WeightItem]:
    """Every checkpoint tensor as (checkpoint name, parameter name, tensor, shard id), for `model`
    (whose layers size the cuts of fused checkpoint tensors), with a head tied to the embedding or
    not, on pipeline stage `pp`."""
    for hf_name, tensor in weights:
        name = _renamed(names, hf_name)
        if name is None or name.endswith(names.ignored):
            continue
        if tied and name == names.head:
            continue  # the embedding is the head; some checkpoints store both
        name = name if not names.prefix or name.startswith(names.prefix) else names.prefix + name
        if tied and name == names.embedding and not pp.is_first:
            # A later stage holds a tied head but not the embedding: the head loads its own copy.
            if pp.is_last:
                yield hf_name, names.head, tensor, None
            continue
        if name.endswith(names.transposed) and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            tensor = tensor.t()
        for old, new in names.replaced:
            name = name.replace(old, new)
        stack = next(((old, new) for old, new in names.experts if name.endswith(old)), None)
        if stack is None:
            yield from _fused(model, names, hf_name, name, tensor)
            continue
        old, new = stack
        for e, part in enumerate(_unstacked(hf_name, tensor)):
            yield from _fused(model, names, hf_name, name[: -len(old)] + new.format(e), part)


def _unstacked(hf_name: str, tensor: Any) -> Sequence[Any]:
    """An expert stack's per-expert tensors: a 3-D tensor's slices along dim 0, or the sequence of
    per-expert 2-D tensors (raw blocks included) a GGUF reader yields for one."""
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() != 3:
            raise ModelLoadError(
                f"weight {hf_name!r}: an expert stack must be 3-D [experts, rows, cols], "
                f"got shape {tuple(tensor.shape)}"
            )
        return tensor.unbind(0)
    return tensor


def _renamed(names: WeightNames, hf_name: str) -> str | None:
    """The name with its first matching `renamed` prefix replaced, or None for a skipped tensor."""
    for old, new in names.renamed:
        if hf_name.startswith(old):
            return None if new is None else new + hf_name[len(old) :]
    return hf_name


def _fused(
    model: nn.Module, names: WeightNames, hf_name: str, name: str, tensor: Any
) -> Iterator[WeightItem]:
    for old, new, shard in names.stacked:
        if old in name:
            yield hf_name, name.replace(old, new), tensor, shard
            return
    for fragment, shards in names.split:
        if fragment in name:
            yield from _split(model, hf_name, name, tensor, shards)
            return
    yield hf_name, name, tensor, None


def _split(
    model: nn.Module, hf_name: str, name: str, tensor: Any, shards: tuple[ShardId, ...]
) -> Iterator[WeightItem]:
    """A fused checkpoint tensor cut along its rows into the parameter's shards."""
    try:
        layer = model.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:  # held by another pipeline stage: skipped whole by the loader
        layer = None
    sizes_of = getattr(layer, "shard_sizes", None)
    sizes = sizes_of() if sizes_of is not None else {}
    widths = [sizes.get(s) for s in shards]
    if any(w is None for w in widths) or tensor.shape[0] != sum(widths):
        yield hf_name, name, tensor, shards[0]  # mis-shaped: the parameter's loader reports it
        return
    start = 0
    for shard, width in zip(shards, widths, strict=True):
        yield hf_name, name, tensor.narrow(0, start, width), shard
        start += width
