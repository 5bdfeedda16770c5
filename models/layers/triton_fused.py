"""A decoder layer's small ops on a GPU in one Triton launch each: RMSNorm with the residual add,
SiLU/GELU-and-mul, and rotary on q and k (after their per-head RMSNorm, where the model has one) with
the step's K/V written into the paged cache.

Measured on an H200 (docs/benchmarks.md, "Results on an H200"): a CUDA-graph decode step of the
default model ran about 850 kernels, 28 a layer, 1.2-4 us each, so a batch-1 step took 2.27 ms for
weights that take 0.06 ms to read, and an 8B model read its weights at 57% of the copy bandwidth. Most
of those kernels were torch's elementwise ops around the matmuls: the residual add and the norm, the
gate slice, SiLU and the product, rotary's gather of cos/sin, its products, negation and concatenation,
and two `index_copy_` for the cache. Here each of those groups is one launch (vLLM's custom ops
fused_add_rms_norm, silu_and_mul and rotary_embedding + reshape_and_cache do the same in CUDA C++).

Arithmetic: float32 inside, rounded to the model dtype where torch's ops round (the sum of x and the
residual, the normalised value before the weight's product, the activation before the product), so
in float32 the results are torch's up to the order of a row's sum of squares. Rotary rounds once at
the end (torch's bfloat16 ops round each product). Every row is computed from its own inputs, so a
row's result does not depend on what shares the batch. On CPU tensors the kernels run in Triton's
interpreter, which is how CI tests them; on a GPU they run where `runs_on` says so.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import triton
import triton.language as tl

# ORCA_GPU_FUSED_OPS=0 runs torch's ops instead (to compare, or to rule the kernels out).
ENABLED = os.environ.get("ORCA_GPU_FUSED_OPS", "1") != "0"
NUM_WARPS = 4
# Columns of one program of the activation kernel (a row of 14336 is 7 programs).
ACT_BLOCK = 2048
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


class Norm(Protocol):
    """What a fused kernel reads of an RMSNorm layer (models.layers.norm.RMSNorm)."""

    weight: torch.Tensor
    eps: float
    scale_in_float32: bool  # Gemma: the weight (1 + w, float32) multiplies before the cast


def runs_on(x: torch.Tensor) -> bool:
    """Whether the fused kernels take `x`'s op: a CUDA tensor of a float type, unless turned off
    (gpu_fused.fused_ops asks, once it knows Triton imports)."""
    return ENABLED and x.is_cuda and x.dtype in FLOAT_TYPES


@triton.jit
def _scaled(normed, w, dtype: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr):
    """normed (float32, x / rms(x)) times the weight w, rounded to `dtype` where torch's norm rounds:
    before the product (Llama) or, Gemma's way, only after it. The caller casts the result."""
    if SCALE_IN_FLOAT32:
        return normed * w
    return normed.to(dtype).to(tl.float32) * w


@triton.jit
def _scaled_rms(x, w, H, eps, SCALE_IN_FLOAT32: tl.constexpr):
    """A row x normalised and scaled by w (_scaled), in float32."""
    xf = x.to(tl.float32)
    return _scaled(xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps), w, x.dtype, SCALE_IN_FLOAT32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] the residual stream, updated in place to x + residual (HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    pre_w_ptr,  # [H] the norm x goes through before the residual add (PRE_NORM)
    stride_x,
    stride_res,
    stride_out,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SCALE_IN_FLOAT32: tl.constexpr,  # Gemma: the weight (1 + w, float32) multiplies before the cast
    PRE_NORM: tl.constexpr,  # Gemma 3's sandwich: x is normalised (pre_w) before it joins the stream
    NORM_OUT: tl.constexpr,  # out = the normalised stream (else only the stream is written)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if PRE_NORM:
        pre_w = tl.load(pre_w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        x = _scaled_rms(x, pre_w, H, eps, SCALE_IN_FLOAT32).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded as torch's add rounds
        tl.store(res_ptr + row * stride_res + offs, x, mask=ok)
    if NORM_OUT:
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = _scaled_rms(x, w, H, eps, SCALE_IN_FLOAT32)
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    scale_in_float32: bool = False,
    pre_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] / rms * weight; with `residual`, x + residual is normalised and written into
    `residual` (in place, as the CPU kernel and vLLM's fused_add_rms_norm do); with `pre_weight`, x
    is first normalised with that weight (Gemma 3's post-attention norm, then its pre-feedforward
    one: two norms and the residual add in one launch)."""
    out = torch.empty_like(x)
    _launch_norm(x, weight, out, eps, residual, scale_in_float32, pre_weight)
    return out


def add_rms_normed(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, scale_in_float32: bool = False
) -> torch.Tensor:
    """residual + x / rms * weight, written into `residual` (in place) and returned: Gemma 3's
    post-feedforward norm and the residual add after it in one launch."""
    _launch_norm(x, weight, None, eps, residual, scale_in_float32, weight)
    return residual


def _launch_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    scale_in_float32: bool,
    pre_weight: torch.Tensor | None,
) -> None:
    t, h = x.shape
    if not t:
        return
    res = residual if residual is not None else x
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(t,)](
        x, res, weight, out if out is not None else x, pre_weight if pre_weight is not None else weight,
        x.stride(0), res.stride(0), out.stride(0) if out is not None else 0, h, eps,
        HAS_RESIDUAL=residual is not None, SCALE_IN_FLOAT32=scale_in_float32,
        PRE_NORM=pre_weight is not None, NORM_OUT=out is not None, BLOCK=block, num_warps=norm_warps(block),
    )  # fmt: skip


def norm_warps(block: int) -> int:
    """Warps of a norm program over a row of `block` columns: 32 values a thread at most (a row of
    16384 would spill in 4 warps)."""
    return max(NUM_WARPS, min(16, block // 1024))


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2 * width]: gate | up
    out_ptr,  # [T, width]
    width,
    stride_x,
    stride_out,
    GELU_TANH: tl.constexpr,  # gelu (tanh approximation) instead of SiLU
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = g * tl.sigmoid(2.0 * z)
    else:
        act = g * tl.sigmoid(g)
    y = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)  # rounded as torch's activation rounds
    tl.store(out_ptr + row * stride_out + cols, y.to(gate.dtype), mask=ok)


def act_and_mul(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I] = act(gate) * up, act SiLU or GELU (tanh approximation)."""
    t, two_i = x.shape
    i = two_i // 2
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t:
        block = min(ACT_BLOCK, triton.next_power_of_2(i))
        _act_and_mul_kernel[(t, triton.cdiv(i, block))](
            x, out, i, x.stride(0), out.stride(0), GELU_TANH=gelu_tanh, BLOCK=block, num_warps=NUM_WARPS
        )
    return out


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr,  # [T, (HQ + 2 HKV) * D]: q and k heads rotated in place
    pos_ptr,  # [T] int64
    cos_sin_ptr,  # [max_positions, R]: cos | sin, R / 2 each
    slot_ptr,  # [T] int64 cache slots (block * block_size + offset)
    k_cache_ptr,  # [slots, HKV, D]
    v_cache_ptr,  # [slots, HKV, D]
    q_norm_ptr,  # [D] the q heads' RMSNorm weight (HAS_QK_NORM)
    k_norm_ptr,  # [D] the k heads'
    stride_qkv,
    stride_cs,
    HQ,
    HKV,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,  # R / 2: the rotated pairs (d, d + HALF) for d < HALF
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,  # Qwen3, Gemma 3: a per-head RMSNorm of q and k before rotary
    NORM_SCALE_IN_FLOAT32: tl.constexpr,  # Gemma: as _rms_norm_kernel's SCALE_IN_FLOAT32
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = qkv_ptr + t * stride_qkv + h * D
    slot = tl.load(slot_ptr + t)
    if h < HQ + HKV:
        pos = tl.load(pos_ptr + t)
        i = tl.arange(0, BLOCK_HALF)
        ok = i < HALF
        rest = 2 * HALF + tl.arange(0, BLOCK_D)  # the dims past the rotary ones (partial rotary)
        rest_ok = rest < D
        x1 = tl.load(base + i, mask=ok, other=0.0)
        x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
        passed = tl.load(base + rest, mask=rest_ok, other=0.0)
        if HAS_QK_NORM:
            # The head's sum of squares from its three pieces, then each piece normalised and rounded
            # as _rms_norm_kernel rounds a row: rotary below reads what the norm would have stored.
            w_ptr = q_norm_ptr if h < HQ else k_norm_ptr
            f1, f2, fr = x1.to(tl.float32), x2.to(tl.float32), passed.to(tl.float32)
            ss = tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0) + tl.sum(fr * fr, axis=0)
            r = tl.rsqrt(ss / D + eps)
            w1 = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
            wr = tl.load(w_ptr + rest, mask=rest_ok, other=0.0).to(tl.float32)
            dt = x1.dtype
            x1 = _scaled(f1 * r, w1, dt, NORM_SCALE_IN_FLOAT32).to(dt)
            x2 = _scaled(f2 * r, w2, dt, NORM_SCALE_IN_FLOAT32).to(dt)
            passed = _scaled(fr * r, wr, dt, NORM_SCALE_IN_FLOAT32).to(dt)
            tl.store(base + rest, passed, mask=rest_ok)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=ok, other=0.0).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * cos - b * sin).to(x1.dtype)
        o2 = (b * cos + a * sin).to(x1.dtype)
        tl.store(base + i, o1, mask=ok)
        tl.store(base + HALF + i, o2, mask=ok)
        if h >= HQ:  # a k head: its rotated values, and the dims past the rotary ones, into the cache
            k_dst = k_cache_ptr + (slot * HKV + (h - HQ)) * D
            tl.store(k_dst + i, o1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_dst + rest, passed.to(k_cache_ptr.dtype.element_ty), mask=rest_ok)
    else:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        v = tl.load(base + d, mask=d_ok, other=0.0)
        v_dst = v_cache_ptr + (slot * HKV + (h - HQ - HKV)) * D
        tl.store(v_dst + d, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)


def fits_rope_and_cache(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The rotary + cache kernel takes this step: CUDA, a contiguous qkv of a float type, and a cache of
    a float type (a q8_0 cache quantizes in torch)."""
    return (
        runs_on(qkv)
        and qkv.dim() == 2
        and qkv.is_contiguous()
        and cos_sin.device == qkv.device
        and k_cache.dtype in FLOAT_TYPES
        and k_cache.is_contiguous()
    )


def rope_and_cache(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], rotated in place
    positions: torch.Tensor,  # [T]
    cos_sin: torch.Tensor,  # [max_positions, R]
    slots: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    num_heads: int,
    qk_norm: tuple[Norm, Norm] | None = None,
) -> None:
    """Rotary on the q and k heads of `qkv` (neox layout: pairs (d, d + R/2) of the first R dims), then
    k and v into the cache at `slots`; with `qk_norm` (q's and k's norms, which RMSNorm.pairs_with
    says share a launch), each q and k head is RMS-normalised first (as rms_norm would, so two
    launches and a concatenation fewer a layer)."""
    t = qkv.shape[0]
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    half = cos_sin.shape[-1] // 2
    if not t:
        return
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    _rope_and_cache_kernel[(t, num_heads + 2 * hkv)](
        qkv, positions, cos_sin, slots, k_cache, v_cache,
        q_norm.weight if q_norm is not None else qkv, k_norm.weight if k_norm is not None else qkv,  # unread
        qkv.stride(0), cos_sin.stride(0), num_heads, hkv, q_norm.eps if q_norm is not None else 0.0,
        D=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(d),
        HAS_QK_NORM=q_norm is not None,
        NORM_SCALE_IN_FLOAT32=q_norm is not None and q_norm.scale_in_float32,
        num_warps=1,
    )  # fmt: skip
