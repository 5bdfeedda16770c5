"""The ctypes mirrors of models/kernels/layers.h: a packed weight (`QWeight`) and a mixture of experts
(`MoELayer`) as the native layer calls (decode_layers.c, moe.c) read them. Shared by the fused decode
layers (native_decode.py) and the expert layer (moe.py), which describe their weights to C once."""

from __future__ import annotations

import ctypes

import torch

from models.kernels.cpu import PRECISION_CODES
from models.layers.linear import PackableLinear

MAX_SEGMENTS = 4  # layers.h: row segments (block formats) a weight may have

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class QWeight(ctypes.Structure):
    _fields_ = [
        ("tiles", _p * MAX_SEGMENTS),
        ("fmt", _i32 * MAX_SEGMENTS),
        ("rows", _i64 * MAX_SEGMENTS),
        ("row_start", _i64 * MAX_SEGMENTS),
        ("num_segments", _i32),
        ("precision", _i32),
        ("N", _i64),
        ("K", _i64),
        ("bias", _p),
    ]


class MoELayer(ctypes.Structure):
    _fields_ = [
        ("router", _p),
        ("gate_up", _p),  # QWeight[num_experts]
        ("down", _p),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("hidden", _i64),
        ("inter", _i64),
        ("normalize", _i32),
        ("softmax_first", _i32),
        ("shared_gate_up", _p),  # QWeight, or NULL
        ("shared_down", _p),
        ("shared_inter", _i64),
        ("shared_gate", _p),  # [hidden] float32, or NULL
    ]


def is_f32(t: torch.Tensor | None) -> bool:
    """A float32, contiguous CPU tensor: what the native calls read in place."""
    return t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def qweight(layer: PackableLinear) -> QWeight | None:
    """The C description of a packed layer, or None if it is not one the C code takes."""
    w = layer.packed
    bias = getattr(layer, "bias", None)
    if w is None or len(w.kernel_args) > MAX_SEGMENTS or (bias is not None and not is_f32(bias)):
        return None
    q = QWeight()
    for i, (tiles, fmt_id, rows, byte_offset) in enumerate(w.kernel_args):
        q.tiles[i], q.fmt[i], q.rows[i], q.row_start[i] = tiles, fmt_id, rows, byte_offset // 4
    q.num_segments = len(w.kernel_args)
    q.precision = PRECISION_CODES[layer.precision]
    q.N, q.K = w.shape
    q.bias = bias.data_ptr() if bias is not None else None
    return q
