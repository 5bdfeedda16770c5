"""Run a loaded model's block-quantized linear weights on the native CPU kernels, and say how.

    summary = pack_model_weights(model, "int8")   # after load_weights, before the first step

What "precision" means for a quantized (GGUF) model: the weights stay in their block format (4.5 to
8.5 bits each, bit-identical to the file's values); the activations a linear layer multiplies them
with are either

    int8     each row quantized per block of 32 (scale max|x| / 127; per super-block of 256 against
             a K-quant, as llama.cpp's Q8_K), integer dot products with the codes, then a float
             multiply-add per block (a K-quant: per super-block): llama.cpp's route, the fastest on every x86
             CPU with AVX2 (vpmaddubsw), AVX512-VNNI (vpdpbusd) or AMX (tile multiplies);
             perplexity within 1% of float32 (tests/models/test_quantized_accuracy.py)
    float32  the weights dequantized exactly in registers, float32 products and sums: the reference
             (parity with transformers up to summation order)

and everything else (norms, attention, the residual stream, the KV cache) runs in the model dtype,
float32. `--weight-packing` (WEIGHT_PACKING_MODES): "auto" = int8 wherever the kernels run; "int8",
"float32" force one; "off" keeps every weight as a float tensor for torch's matmuls.

Packing happens only on CPU in float32 and where the kernels build; it is exact (packed_weight.py),
so a model computes the same function before and after, up to the activations' precision.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from models.base import CausalLMBase
from models.kernels import cpu as cpu_kernels
from models.kernels.cpu import Precision
from models.layers.huge_pages import huge_page_slots, release_freed_memory
from models.layers.linear import PackableLinear
from models.layers.packed_weight import PackedWeight
from models.options import WEIGHT_PACKING_MODES

log = logging.getLogger(__name__)


@dataclass
class PackingSummary:
    """What packing did; formats, precision and bytes are read off the model (describe_cpu_setup)."""

    packed: int  # layers whose weight is now block-quantized
    layers: int  # packable layers looked at
    seconds: float


def packable_layers(model: nn.Module) -> list[PackableLinear]:
    """The layers whose weight may be packed (linear layers and LM heads), in module order."""
    return [m for m in model.modules() if isinstance(m, PackableLinear)]


def linear_precision(mode: str) -> Precision | None:
    """The activations' precision a --weight-packing mode asks for (None: no packing)."""
    if mode not in WEIGHT_PACKING_MODES:
        raise ValueError(f"weight_packing must be one of {WEIGHT_PACKING_MODES}, got {mode!r}")
    # "auto": int8 activations are the fastest path on every variant (AVX2 included: vpmaddubsw
    # reads 4x fewer activation bytes than float32 FMAs and does 2x the multiply-adds per op).
    return {"auto": "int8", "int8": "int8", "float32": "float32", "off": None}[mode]


def should_pack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    return (
        linear_precision(mode) is not None
        and device.type == "cpu"
        and dtype == torch.float32
        and cpu_kernels.available()
    )


def pack_model_weights(model: nn.Module, precision: Precision = "int8") -> PackingSummary:
    start = time.perf_counter()
    layers = packable_layers(model)
    packed = sum(layer.pack_weight(precision) is not None for layer in layers)
    move_to_huge_pages([layer.packed for layer in layers if layer.packed is not None])
    if isinstance(model, CausalLMBase):
        model.prepare_native_decode()  # decode steps' layers in one native call, where they fit
    summary = PackingSummary(packed, len(layers), time.perf_counter() - start)
    log.debug("packed %d of %d linear weights in %.2f s", summary.packed, summary.layers, summary.seconds)
    return summary


def move_to_huge_pages(weights: list[PackedWeight]) -> None:
    """Every packed weight's tiles into one huge-page mapping (models/layers/huge_pages.py: a decode
    step streams them faster), each weight once (a tied embedding and head share one), before the
    native decode layers take the tiles' addresses."""
    unique = list({id(w): w for w in weights}.values())
    slots = iter(huge_page_slots([s.tiles for w in unique for s in w.segments]))
    for w in unique:  # weight by weight: each one's old tiles are dropped as soon as it is copied
        w.replace_tiles([next(slots).copy_(s.tiles) for s in w.segments])
    release_freed_memory()


def describe_cpu_setup(model: nn.Module) -> str:
    """One line for the server's start-up log: the kernels' ISA variant, the linear layers' precision
    and formats, the bytes of weights a decode step reads, and all weights in memory against their file."""
    k = cpu_kernels.kernels()
    layers = packable_layers(model)
    packed = [layer for layer in layers if layer.packed is not None]
    isa = f"{k.name} kernels ({k.variant.description})" if k else "no native kernels (torch ops)"
    if not packed:
        return f"CPU: {isa}; linear layers: torch float matmuls; {describe_weight_memory(model)}"
    formats = Counter(f for layer in packed for f in layer.packed.formats)
    precisions = sorted({layer.precision for layer in packed})
    # A tied LM head and its embedding share one packed table: count its bytes once.
    packed_bytes = sum({id(layer.packed): layer.packed.nbytes for layer in packed}.values())
    float_bytes = sum(
        layer.weight.numel() * layer.weight.element_size()
        for layer in layers
        if layer.packed is None and layer.weight is not None
    )
    native = model.native_decode if isinstance(model, CausalLMBase) else None
    decode = f"; decode steps: {len(native.layers)} layers in one native call" if native is not None else ""
    return (
        f"CPU: {isa}; {len(packed)} of {len(layers)} linear layers on the quantized kernel "
        f"({', '.join(f'{n} {name}' for name, n in sorted(formats.items()))}) with "
        f"{'/'.join(precisions)} activations; linear weights {(packed_bytes + float_bytes) / 1e6:.1f} MB"
        f"{decode}; {describe_weight_memory(model)}"
    )


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes every weight of the model holds: packed block-quantized weights and float parameters
    (each shared one counted once)."""
    packed = {id(layer.packed): layer.packed.nbytes for layer in packable_layers(model) if layer.packed}
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(packed.values()) + sum(params.values())


def describe_weight_memory(model: nn.Module) -> str:
    """All weights in memory, against the size of the file(s) they came from."""
    held = weight_memory_bytes(model)
    file_bytes = getattr(model, "weight_file_bytes", None)
    against = f" ({held / file_bytes:.2f}x the {file_bytes / 1e6:.1f} MB weight file)" if file_bytes else ""
    return f"all weights {held / 1e6:.1f} MB in memory{against}"
