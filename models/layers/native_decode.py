"""A decode step's decoder layers in one native call (models/kernels/decode_layers.c).

At batch 1 on a small CPU a step of the default model makes ~300 small calls (norms, 4 quantized
linears, rotary and cache write, attention, activation, per layer), and each one's Python (module
call, checks, a fresh output tensor, ctypes) costs more than its arithmetic: 17.7 ms a step against
4.6 ms for the linears themselves on a 2-core AVX2 EPYC (issue #12). `NativeDecodeLayers` describes
the layers' weights to C once and then runs a whole stage of layers per step in one call, with the same
kernels in the same order, so the output is bit-identical to the module-by-module forward.

It applies to a step in which every sequence has one new token (decode only), on the cpu-decode
attention backend with the native kernels, in one process per stage (no tensor parallelism: the C
code has no all-reduce), when every linear of the layers is packed (GGUF blocks) and all tensors are
float32 but the KV cache, which may hold any --kv-cache-dtype (float32, float16, bfloat16, q8_0: the C
code writes and reads it in its own type). Anything else, including a mixed step with a prompt chunk,
runs the modules as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.kernels import cpu as cpu_kernels
from models.layers.attention import Attention, AttentionStep
from models.layers.attention_backends import BatchedDecodeBackend
from models.layers.linear import PackableLinear
from models.layers.metadata import KVCache
from models.layers.native_weights import MoELayer, QWeight, is_f32, qweight
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding

_p, _i64, _i32, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("qkv", QWeight),
        ("o", QWeight),
        ("gate_up", QWeight),
        ("down", QWeight),
        ("k_cache", _p),
        ("v_cache", _p),
        ("cos_sin", _p),
        ("window", _i64),
        ("q_norm", _p),
        ("k_norm", _p),
        ("attn_out_norm", _p),
        ("mlp_out_norm", _p),
        ("gelu", _i32),
        ("q_proj_norm", _p),
        ("k_proj_norm", _p),
        ("clip", _f),
        ("moe", _p),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f),
        ("scale", _f),
        ("block_size", _i64),
        ("rotary_dim", _i64),
        ("kv_type", _i32),
    ]


def _is_cache(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A KV cache tensor the C code reads in place (rows in any of the kernels' element types)."""
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


# The MLP activations decode_layers.c runs (its `gelu` flag).
ACTIVATIONS = ("silu", "gelu_tanh")


class NormWeights(Protocol):
    """A norm as the native call reads it: its weight (float32) and epsilon."""

    weight: torch.Tensor
    eps: float


class NativeMLP(Protocol):
    """An MLP that describes itself to the native calls (models/layers/moe.py's SparseMoE)."""

    def native_struct(self) -> MoELayer | None:
        """Its C description (kept alive by the module), or None where the modules must run it."""
        ...


@dataclass(frozen=True)
class DecodeLayerParts:
    """One pre-norm decoder layer as decode_layers.c runs it (Llama's layout): input norm, fused qkv,
    rotary (partial where the table is narrower than a head) and the cache write, paged attention, o,
    the residual add fused into the post-attention norm, fused gate/up, SiLU-and-mul, down, residual
    add. A family declares how its layer maps onto this (`ModelFamily.native_decode`); a layer that
    does not fit returns None from that function.

    The optional parts: per-head q/k norms before rotary (Qwen3's, Gemma 3's); OLMoE's norms over the
    whole q and k projections and its clipping of q, k and v; Gemma 3's norm on the attention output
    and on the MLP output before their residual adds (`post_norm` is then its pre-feedforward norm),
    GELU-tanh, and per layer its own rotary table and window (`attention.sliding_window`); and a
    mixture of experts (`experts`) in place of gate_up and down."""

    input_norm: RMSNorm
    qkv: PackableLinear
    rotary: RotaryEmbedding
    attention: Attention  # head counts (this rank's), head_dim, scale and sliding window
    o: PackableLinear
    post_norm: RMSNorm
    gate_up: PackableLinear | None  # None where `experts` is the MLP
    down: PackableLinear | None
    # Per-head RMSNorm of q and k after the qkv projection (weights [head_dim]); both or neither.
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    # RMSNorm over the whole q and k projections (weights [heads * head_dim], [kv_heads * head_dim]),
    # both or neither, then q, k and v clipped to [-clip, clip] (None: not clipped).
    q_proj_norm: NormWeights | None = None
    k_proj_norm: NormWeights | None = None
    clip: float | None = None
    attn_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    activation: str = "silu"  # one of ACTIVATIONS
    experts: NativeMLP | None = None

    def norms(self) -> list[NormWeights]:
        """Every norm of the layer (the optional ones it has)."""
        optional = (self.q_norm, self.k_norm, self.q_proj_norm, self.k_proj_norm)
        optional += (self.attn_out_norm, self.mlp_out_norm)
        return [self.input_norm, self.post_norm, *(n for n in optional if n is not None)]


def _pair_fits(a: NormWeights | None, b: NormWeights | None, widths: tuple[int, int]) -> bool:
    """Both norms or neither, of these widths."""
    if a is None or b is None:
        return a is b
    return (tuple(a.weight.shape), tuple(b.weight.shape)) == ((widths[0],), (widths[1],))


def _mlp_fits(layer: DecodeLayerParts, s: _Layer) -> bool:
    """Describe the layer's MLP (dense or experts) in its struct; False where the C code cannot run it."""
    if layer.experts is not None:
        moe = layer.experts.native_struct()
        s.moe = ctypes.addressof(moe) if moe is not None else None
        return moe is not None
    if layer.gate_up is None or layer.down is None or layer.activation not in ACTIVATIONS:
        return False
    gate_up, down = qweight(layer.gate_up), qweight(layer.down)
    if gate_up is None or down is None:
        return False
    s.gate_up, s.down = gate_up, down
    s.gelu = ACTIVATIONS.index(layer.activation)
    return True


def _ptr(norm: NormWeights | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


class NativeDecodeLayers:
    """One pipeline stage's decoder layers, described to decode_layers.c."""

    def __init__(self, parts: Sequence[DecodeLayerParts], shape: _Shape, structs: ctypes.Array) -> None:
        self.layers = parts
        self.shape = shape
        self.structs = structs
        self._caches: list[KVCache] | None = None  # the caches whose addresses `structs` holds
        self._lib = cpu_kernels.kernels().lib  # type: ignore[union-attr]

    @classmethod
    def build(cls, parts: Sequence[DecodeLayerParts | None], tp_size: int) -> NativeDecodeLayers | None:
        """The native description of these layers, or None where the modules must run them."""
        if tp_size != 1 or not parts or not cpu_kernels.available() or any(p is None for p in parts):
            return None
        layers: list[DecodeLayerParts] = [p for p in parts if p is not None]
        structs = (_Layer * len(layers))()
        first = layers[0]
        attn = first.attention
        d, hq, hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        cos_sin = first.rotary.cos_sin_cache
        rotary = cos_sin.shape[-1]  # the rotated dims of a head (partial rotary: fewer than d)
        if not (
            rotary <= d
            and rotary % 16 == 0
            and d % 16 == 0
            and cpu_kernels.supports_decode_attention(d, hq, hkv)
        ):
            return None
        hidden = first.input_norm.weight.shape[0]
        for i, layer in enumerate(layers):
            table = layer.rotary.cos_sin_cache
            a = layer.attention
            s = structs[i]
            if (
                not (is_f32(table) and tuple(table.shape) == tuple(cos_sin.shape))
                or (a.scale, a.head_dim, a.num_heads, a.num_kv_heads) != (attn.scale, d, hq, hkv)
                or any(n.eps != first.input_norm.eps or not is_f32(n.weight) for n in layer.norms())
                or not _pair_fits(layer.q_norm, layer.k_norm, (d, d))
                or not _pair_fits(layer.q_proj_norm, layer.k_proj_norm, (hq * d, hkv * d))
                or not _mlp_fits(layer, s)
            ):
                return None
            qkv, o = qweight(layer.qkv), qweight(layer.o)
            if qkv is None or o is None:
                return None
            s.input_norm, s.post_norm = layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()
            s.qkv, s.o = qkv, o
            s.cos_sin = table.data_ptr()
            s.window = a.sliding_window or 0
            s.q_norm, s.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            s.q_proj_norm, s.k_proj_norm = _ptr(layer.q_proj_norm), _ptr(layer.k_proj_norm)
            s.clip = layer.clip or 0.0
            s.attn_out_norm, s.mlp_out_norm = _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm)
        shape = _Shape(
            hidden=hidden,
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            # The dense MLPs' width (the workspace's; experts have their own), 0 where every MLP is experts.
            intermediate=max((x.down.packed.shape[1] for x in layers if x.down is not None), default=0),
            eps=first.input_norm.eps,
            scale=attn.scale,
            rotary_dim=rotary,
        )
        return cls(layers, shape, structs)

    def _point_at(self, kv_caches: list[KVCache]) -> bool:
        """Write the caches' addresses into the layer structs (once per set of caches)."""
        if len(kv_caches) != len(self.layers):
            return False
        if self._caches is not None and all(
            k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv_caches, self._caches, strict=True)
        ):
            return True
        a = self.layers[0].attention
        kv_dtype = kv_caches[0][0].dtype
        row = cpu_kernels.kv_row_width(kv_dtype, a.head_dim)
        if row is None or not cpu_kernels.supports_decode_attention(
            a.head_dim, a.num_heads, a.num_kv_heads, kv_dtype
        ):
            return False
        for i, (k, v) in enumerate(kv_caches):
            if not (
                _is_cache(k, kv_dtype) and _is_cache(v, kv_dtype) and k.shape == v.shape and k.dim() == 4
            ):
                return False
            if tuple(k.shape[2:]) != (a.num_kv_heads, row):
                return False
            self.structs[i].k_cache, self.structs[i].v_cache = k.data_ptr(), v.data_ptr()
        self.shape.block_size = kv_caches[0][0].shape[1]
        self.shape.kv_type = cpu_kernels.KV_TYPE_CODES[kv_dtype]
        self._caches = [tuple(c) for c in kv_caches]  # type: ignore[misc]
        return True

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: list[KVCache], step: AttentionStep
    ) -> torch.Tensor | None:
        """The layers' output for a decode-only step ([T, hidden]: `hidden` itself, updated in place as
        the modules' fused residual add updates it), or None when this step is not one the native call
        takes (the caller then runs the modules)."""
        md, plan = step.metadata, step.plan
        t = hidden.shape[0]
        if not (
            md.is_decode_only
            and type(step.backend) is BatchedDecodeBackend
            and plan.num_decodes == t
            and is_f32(hidden)
            and hidden.shape[-1] == self.shape.hidden
            and positions.dtype == md.slot_mapping.dtype == torch.int64
            and self._point_at(kv_caches)
        ):
            return None
        pos, slots = positions.contiguous(), md.slot_mapping.contiguous()
        tables, lens = plan.block_tables, plan.seq_lens
        with cpu_kernels.labelled("decode_layers"):
            rc = self._lib.orca_decode_layers(
                ctypes.addressof(self.structs),
                len(self.layers),
                ctypes.addressof(self.shape),
                hidden.data_ptr(),
                t,
                pos.data_ptr(),
                slots.data_ptr(),
                tables.data_ptr(),
                lens.data_ptr(),
                tables.shape[1],
            )
        if rc:
            raise RuntimeError(f"native decode layers failed (rc {rc}) on {t} tokens")
        return hidden
