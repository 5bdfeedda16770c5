"""Pack a loaded model's linear weights for the group-int8 CPU kernel where that is lossless.

    summary = pack_model_weights(model)   # after load_weights, before the first step

Only on CPU in float32 (the kernel computes in float32) and where the kernel builds. Packing is exact
(packed_weight.py): a model computes the same function before and after, up to float32 summation order,
so it is on by default; `weight_packing="off"` keeps every weight in float32.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.layers.linear import PackableLinear

log = logging.getLogger(__name__)

WEIGHT_PACKING_MODES = ("auto", "off")


@dataclass
class PackingSummary:
    packed: int  # layers whose weight is now int8 codes + group scales
    layers: int  # packable layers looked at
    float_bytes: int  # float32 bytes of the packed weights
    packed_bytes: int  # what they take packed
    seconds: float


def packable_layers(model: nn.Module) -> list[PackableLinear]:
    """The layers whose weight may be packed (linear layers and LM heads), in module order."""
    return [m for m in model.modules() if isinstance(m, PackableLinear)]


def should_pack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    if mode not in WEIGHT_PACKING_MODES:
        raise ValueError(f"weight_packing must be one of {WEIGHT_PACKING_MODES}, got {mode!r}")
    return mode == "auto" and device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available()


def pack_model_weights(model: nn.Module) -> PackingSummary:
    start = time.perf_counter()
    layers = packable_layers(model)
    packed = float_bytes = packed_bytes = 0
    for layer in layers:
        numel = layer.weight.numel() if layer.weight is not None else 0
        p = layer.pack_weight()
        if p is not None:
            packed += 1
            float_bytes += numel * 4
            packed_bytes += p.nbytes
    summary = PackingSummary(packed, len(layers), float_bytes, packed_bytes, time.perf_counter() - start)
    if packed:
        log.info(
            "packed %d of %d linear weights as group-int8 (%.0f MB -> %.0f MB) in %.1f s",
            packed,
            len(layers),
            float_bytes / 1e6,
            packed_bytes / 1e6,
            summary.seconds,
        )
    return summary
