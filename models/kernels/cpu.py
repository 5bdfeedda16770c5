"""The native CPU kernels: build once per ISA variant, load the one this CPU runs, call.

    quant_linear.c            y = x @ W^T for block-quantized weights (GGUF's Q4_0 ... Q6_K, Q2_K, Q3_K,
                              IQ4_XS, tiled as quant_tiles.h describes): int8 activations or float32
    paged_decode_attention.c  one-token-per-sequence attention read in place from the paged KV cache
    elementwise.c             RMSNorm (with the residual add fused in), per-head q/k RMSNorm, SiLU-and-mul,
                              GELU(tanh)-and-mul, and rotary + KV cache write, one call each
    decode_layers.c           a decode step's decoder layers in one call, out of the kernels above
                              (models/layers/native_decode.py)
    moe.c                     a mixture of experts' MLP in one call: router, routing, each chosen
                              expert once over its grouped tokens (models/layers/moe.py)
    variant.c                 what a build was compiled for; the AMX permission request
    simd.h, vec.h             shared vector helpers (vec.h: one vector type per variant)
    layers.h                  packed weights and experts as decode_layers.c and moe.c read them
    kv_types.h                the KV cache's element types (float32, float16, bfloat16, q8_0): row
                              sizes, widening loads and narrowing stores

The C files are compiled together on first use with the system C compiler (`cc`, OpenMP) into one
library per ISA variant (isa.py: avx2, avx512, avx512_vnni, amx), each with its own -m flags, in the
orca-serve cache, named by the variant and a hash of the sources and flags, so an edited kernel is
rebuilt and a finished build is reused by every later process. Only the chosen variant's library is
loaded, so no instruction the CPU lacks is ever executed. Plain C and ctypes rather than a torch C++
extension: a build takes seconds instead of a minute of compiling torch headers, and needs no ninja.
ctypes releases the GIL during a call; OpenMP in the library resolves to torch's own libgomp (already
loaded), so the kernels and torch share one thread pool.

Everything here degrades to "not available" (callers keep their torch paths): a CPU without AVX2/FMA,
no compiler, a failed build, or ORCA_CPU_KERNELS=off. The reason is logged once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar

import torch

from models.kernels.isa import VARIANTS, Variant, cpu_flags, requested_variant, variant_named
from models.options import cache_root


class _BlockFormat(Protocol):
    id: int  # QF_* in quant_tiles.h


class TiledSegment(Protocol):
    """Rows of a weight in one block format, tiled as quant_tiles.h describes."""

    tiles: torch.Tensor  # uint8, contiguous
    fmt: _BlockFormat
    rows: int
    row_start: int


class TiledWeight(Protocol):
    """What the kernels read of a packed weight (models/layers/packed_weight.PackedWeight, checked when it
    was built): a Protocol, so the kernels know no layer or loader."""

    shape: tuple[int, int]
    segments: tuple[TiledSegment, ...]
    # Per segment: (tiles address, format id, rows, byte offset of its first output column).
    kernel_args: tuple[tuple[int, int, int, int], ...]


__all__ = ["cpu_flags", "available", "kernels", "for_variant", "Kernels", "Precision"]

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# -ffp-contract=off: no multiply and add fused behind our back, so every variant computes exactly the
# operations written (the quantized linear's results are bit-identical across variants).
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)

# Activations of a quantized linear: int8 per block of 32, or per 256 against a K-quant (integer dot
# products), or float32.
Precision = Literal["int8", "float32"]
PRECISION_CODES: dict[str, int] = {"float32": 0, "int8": 1}
# What orca_build_isa() says for each variant's build.
BUILD_ISA = {
    "avx2": "avx2",
    "avx512": "avx2+avx512",
    "avx512_vnni": "avx2+avx512+vnni",
    "amx": "avx2+avx512+vnni+amx",
}


def _build(
    target: Path, variant: Variant, sources: Sequence[Path] = SOURCES, extra_cflags: Sequence[str] = ()
) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, *variant.cflags, *extra_cflags, *map(str, sources), "-o", tmp, *LIBS],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent process sees no library or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(variant: Variant) -> Path:
    sources = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join((*CFLAGS, *variant.cflags)).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"orca_cpu_kernels-{variant.name}-{digest}.so"


def build(variant: Variant) -> Path:
    """The variant's library, compiled now unless a finished build is cached. Compiling needs only the
    compiler, not the ISA: an image can carry every variant and run the one its host supports."""
    target = library_path(variant)
    if not target.is_file():
        _build(target, variant)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.orca_build_isa.restype = ctypes.c_char_p
    lib.orca_build_isa.argtypes = []
    lib.orca_isa_init.restype = ctypes.c_int
    lib.orca_isa_init.argtypes = []
    lib.orca_qtile_bytes.restype = i64
    lib.orca_qtile_bytes.argtypes = [i32, i64]
    lib.orca_qlinear.restype = ctypes.c_int
    lib.orca_qlinear.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, i64, i32]
    lib.orca_qdequant_rows.restype = ctypes.c_int
    lib.orca_qdequant_rows.argtypes = [ptr, i32, i64, i64, ptr, i64, ptr]
    lib.orca_paged_decode_attention.restype = ctypes.c_int
    lib.orca_paged_decode_attention.argtypes = [ptr] * 5 + [i64] * 6 + [ctypes.c_float, i64, i32, ptr]
    lib.orca_paged_prefill_attention.restype = ctypes.c_int
    lib.orca_paged_prefill_attention.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, i64, i32, ptr]
    lib.orca_rms_norm.restype = None
    lib.orca_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr]
    lib.orca_qk_norm.restype = None
    lib.orca_qk_norm.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_float]
    lib.orca_silu_and_mul.restype = None
    lib.orca_silu_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.orca_gelu_tanh_and_mul.restype = None
    lib.orca_gelu_tanh_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.orca_rope_and_cache.restype = None
    lib.orca_rope_and_cache.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i32]
    lib.orca_decode_layers.restype = ctypes.c_int
    lib.orca_decode_layers.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64]
    lib.orca_moe.restype = ctypes.c_int
    lib.orca_moe.argtypes = [ptr, ptr, i64, ptr]
    lib.orca_router_logits.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.orca_moe_route.argtypes = [ptr, i64, i64, i64, i32, i32, ptr, ptr]


@functools.cache
def for_variant(name: str) -> Kernels:
    """The kernels of one variant, built and loaded (tests and comparisons run every variant the CPU
    supports). Raises RuntimeError when this CPU or machine cannot run it."""
    variant = _runnable(name)
    return _load(lambda: build(variant), variant)


def for_sources(src: Path, name: str, extra_cflags: Sequence[str] = ()) -> Kernels:
    """The kernels of one variant built from another copy of this directory's sources (src: e.g. a git
    worktree's models/kernels) with extra compiler flags: the two sides of `python -m engine.kernel_ab`.
    Built now, every call (a comparison wants the tree as it is), into a file removed once loaded."""
    variant = _runnable(name)
    sources = tuple(sorted(Path(src).glob("*.c")))
    if not sources:
        raise RuntimeError(f"no kernel sources (*.c) in {src}")

    with tempfile.TemporaryDirectory(prefix="orca-kernel-ab-") as tmp:
        target = Path(tmp) / f"orca_cpu_kernels-{name}.so"

        def built() -> Path:
            _build(target, variant, sources, extra_cflags)
            return target

        return _load(built, variant)  # once loaded, the file can go


def _runnable(name: str) -> Variant:
    """The variant called `name`; RuntimeError when this CPU cannot run it."""
    variant = variant_named(name)
    if not variant.supported():
        missing = sorted(set(variant.cpu_flags) - cpu_flags())
        raise RuntimeError(f"this CPU cannot run the {name} kernels (lacks {', '.join(missing)})")
    return variant


def _load(built: Callable[[], Path], variant: Variant) -> Kernels:
    """A built library of `variant`, loaded, declared and checked (its ISA, its AMX tile state)."""
    name = variant.name
    try:
        lib = ctypes.CDLL(str(built()))
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the {name} kernels did not build or load: {e}") from None
    _declare(lib)
    isa = lib.orca_build_isa().decode()
    if isa != BUILD_ISA[name]:
        raise RuntimeError(f"the {name} kernel library was compiled for {isa}, not {BUILD_ISA[name]}")
    if lib.orca_isa_init() != 0:
        raise RuntimeError(f"the {name} kernels cannot run here: the kernel refused the AMX tile state")
    return Kernels(variant, lib)


@functools.cache
def kernels() -> Kernels | None:
    """The kernels this process uses: the variant ORCA_CPU_KERNELS forces, else the best this CPU
    supports (falling back to the next one down when a variant cannot run); None when none can."""
    variant, why = requested_variant()
    if variant is None:
        log.info("native CPU kernels off: %s", why)
        return None
    candidates = [variant] if "forced" in why else [v for v in reversed(VARIANTS) if v.supported()]
    for v in candidates:
        try:
            k = for_variant(v.name)
        except RuntimeError as e:
            log.warning("native CPU kernels: %s", e)
            continue
        log.info("native CPU kernels: %s (%s; %s)", v.name, v.description, why)
        return k
    log.warning("native CPU kernels unavailable (torch paths are used instead)")
    return None


def available() -> bool:
    return kernels() is not None


def build_all() -> list[str]:
    """Compile every variant into the cache (a container image built on one CPU and run on others)."""
    built = []
    for v in VARIANTS:
        try:
            build(v)
            built.append(v.name)
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            log.warning("could not build the %s kernels: %s", v.name, e)
    return built


# The KV cache's element types (kv_types.h), by the dtype of the cache tensor: uint8 is llama.cpp's
# q8_0 (blocks of 32 int8 codes after one half scale, 34 bytes).
KV_TYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.uint8: 3,
}
Q8_0_VALUES, Q8_0_BYTES = 32, 34


def kv_row_width(dtype: torch.dtype, head_dim: int) -> int | None:
    """Elements of a cache row of head_dim values in `dtype`, or None for a layout the kernels lack."""
    if dtype == torch.uint8:
        return head_dim // Q8_0_VALUES * Q8_0_BYTES if head_dim % Q8_0_VALUES == 0 else None
    return head_dim if dtype in KV_TYPE_CODES else None


def _require_cache(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> int:
    """A KV cache tensor the kernels read in place: contiguous, on the CPU, [..., Hkv, row] with rows of
    head_dim values (shape's last entry) in one of KV_TYPE_CODES. Returns its type code."""
    row = kv_row_width(t.dtype, shape[-1])
    if row is None or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous CPU cache of float32, float16, bfloat16 or uint8 (q8_0, head_dim "
            f"a multiple of {Q8_0_VALUES}), got {t.dtype} on {t.device}"
        )
    if tuple(t.shape) != (*shape[:-1], row):
        raise ValueError(f"{name}: expected shape {(*shape[:-1], row)}, got {tuple(t.shape)}")
    return KV_TYPE_CODES[t.dtype]


def _require_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, shape: tuple[int, ...]) -> int:
    """A layer's K and V caches (_require_cache), of one type. Returns its code."""
    kv_type = _require_cache("k_cache", k_cache, shape)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: {v_cache.dtype}, but k_cache is {k_cache.dtype}")
    _require_cache("v_cache", v_cache, shape)
    return kv_type


def _require_f32(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """The C code trusts its pointers: a wrong dtype, layout or shape would read out of bounds, so it
    is refused here (metadata-only checks, no pass over the data). Index contents (block tables,
    positions, slots) are the engine's to validate, which build_step_inputs does for every step."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


@dataclass(frozen=True)
class _PagedCall:
    """The arguments the paged attention kernels share, checked: q, the caches, the block tables, and
    the output they write. Each kernel's own per-sequence lengths go between head() and tail()."""

    q: torch.Tensor  # contiguous float32 [rows, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_type: int
    tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    out: torch.Tensor  # like q

    @staticmethod
    def check(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        n: int,
    ) -> _PagedCall:
        num_blocks, block_size, hkv, _ = k_cache.shape
        q = q.contiguous()
        _require_f32("q", q)
        kv_type = _require_caches(k_cache, v_cache, (num_blocks, block_size, hkv, q.shape[-1]))
        tables = block_tables.to(torch.int32).contiguous()
        if tables.dim() != 2 or tables.shape[0] != n or tuple(seq_lens.shape) != (n,):
            raise ValueError(
                f"block_tables {tuple(tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match {n} sequences"
            )
        return _PagedCall(q, k_cache, v_cache, kv_type, tables, torch.empty_like(q))

    def head(self) -> tuple[int, ...]:
        return self.q.data_ptr(), self.k_cache.data_ptr(), self.v_cache.data_ptr(), self.tables.data_ptr()

    def tail(self, n: int, scale: float, window: int | None) -> tuple[Any, ...]:
        _, hq, d = self.q.shape
        _, block_size, hkv, _ = self.k_cache.shape
        sizes = (n, hq, hkv, d, block_size, self.tables.shape[1])
        return (*sizes, scale, window or 0, self.kv_type, self.out.data_ptr())


class Kernels:
    """One variant's library, with torch-tensor wrappers around its entry points."""

    def __init__(self, variant: Variant, lib: ctypes.CDLL) -> None:
        self.variant = variant
        self.lib = lib

    @property
    def name(self) -> str:
        return self.variant.name

    def tile_bytes(self, fmt_id: int, k: int) -> int:
        return int(self.lib.orca_qtile_bytes(fmt_id, k))

    def quant_linear(self, x: torch.Tensor, w: TiledWeight, precision: Precision = "int8") -> torch.Tensor:
        """x [..., K] float32 @ W^T for a packed weight (validated when it was built), with int8 or
        float32 activations."""
        n, k = w.shape
        # The forward pass's own case (2-D, contiguous, float32, CPU) goes straight through: this runs
        # 121 times a decode step for the default model, and the generic reshaping and checks cost
        # ~6 us a call, 7% of a batch-1 step.
        if x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu":
            x2, lead = x, None
        else:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            _require_f32("x", x2)
        m, kx = x2.shape
        if kx != k:
            raise ValueError(f"x: last dim {kx} does not match the weight's {k}")
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            code, xp, yp = PRECISION_CODES[precision], x2.data_ptr(), y.data_ptr()
            for tiles, fmt_id, rows, offset in w.kernel_args:
                if self.lib.orca_qlinear(xp, m, k, tiles, fmt_id, rows, yp + offset, n, code):
                    raise ValueError(f"quantized linear: bad shapes x {tuple(x2.shape)}, weight {(n, k)}")
        return y if lead is None else y.view(*lead, n)

    def dequant_rows(self, w: TiledWeight, rows: torch.Tensor) -> torch.Tensor:
        """W[rows] as float32 [len(rows), K], exactly as gguf-py dequantizes (embedding lookups)."""
        n, k = w.shape
        flat = rows.reshape(-1).to(torch.int64)
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        if not flat.numel():
            return out.view(*rows.shape, k)
        if int(flat.min()) < 0 or int(flat.max()) >= n:
            raise IndexError(f"row index out of range for a weight of {n} rows")
        for seg in w.segments:
            if len(w.segments) == 1:
                sel, local, dst = None, flat.contiguous(), out
            else:
                sel = ((flat >= seg.row_start) & (flat < seg.row_start + seg.rows)).nonzero().squeeze(1)
                if not sel.numel():
                    continue
                local = (flat[sel] - seg.row_start).contiguous()
                dst = torch.empty(local.numel(), k, dtype=torch.float32)
            rc = self.lib.orca_qdequant_rows(
                seg.tiles.data_ptr(), seg.fmt.id, k, seg.rows, local.data_ptr(), local.numel(), dst.data_ptr()
            )
            if rc:
                raise ValueError(f"dequantize rows: bad arguments (rc {rc})")
            if sel is not None:
                out[sel] = dst
        return out.view(*rows.shape, k)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """[n, Hq, D] attention of one query token per sequence over its cached history: the whole of it,
        or with a sliding `window` its last `window` tokens (the query's own among them).

        q [n, Hq, D] float32; caches [num_blocks, block_size, Hkv, row]: float32, float16 or bfloat16 rows
        of D values, or uint8 rows of D / 32 q8_0 blocks (KV_TYPE_CODES), read in place in their own type;
        block_tables [n, max_blocks] and seq_lens [n] int32. Sequence i's token t is at block
        block_tables[i, t // block_size].
        """
        n = q.shape[0]
        lens = seq_lens.to(torch.int32).contiguous()
        call = _PagedCall.check(q, k_cache, v_cache, block_tables, lens, n)
        rc = self.lib.orca_paged_decode_attention(*call.head(), lens.data_ptr(), *call.tail(n, scale, window))
        if rc:
            raise ValueError(
                f"paged decode attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
            )
        return call.out

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """[T, Hq, D] causal attention of the prompt chunks of a step over their paged histories:
        sequence i's query_lens[i] rows (back to back in q) are the last of its seq_lens[i] positions,
        each seeing the keys up to its own (with a sliding `window`, its last `window` of them).

        q [T, Hq, D] float32, T = sum(query_lens); caches and block_tables [n, max_blocks] as for
        paged_decode_attention; query_lens, seq_lens [n] int32. A row's result does not depend on how
        its prompt was chunked or what else is in the step (paged_prefill_attention.c).
        """
        qlens = query_lens.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        n = qlens.shape[0]
        if int(qlens.sum()) != q.shape[0]:
            raise ValueError(f"query_lens {qlens.tolist()} do not match {q.shape[0]} query rows")
        call = _PagedCall.check(q, k_cache, v_cache, block_tables, lens, n)
        rc = self.lib.orca_paged_prefill_attention(
            *call.head(), qlens.data_ptr(), lens.data_ptr(), *call.tail(n, scale, window)
        )
        if rc:
            raise ValueError(
                f"paged prefill attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
                " or lengths (each query_len in 1..seq_len)"
            )
        return call.out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x / rms(x) * weight over the last dim. With `residual`, x + residual is normalised and also
        written into `residual` (in place: the caller's next residual stream), as vLLM's
        fused_add_rms_norm."""
        h = x.shape[-1]
        _require_f32("x", x)
        _require_f32("weight", weight, (h,))
        if residual is not None:
            _require_f32("residual", residual, tuple(x.shape))
        if h % 8:
            raise ValueError(f"rms_norm: width {h} is not a multiple of 8")
        out = torch.empty_like(x)
        rows = x.numel() // h if h else 0
        if rows:
            res_ptr = residual.data_ptr() if residual is not None else None
            self.lib.orca_rms_norm(x.data_ptr(), res_ptr, weight.data_ptr(), eps, rows, h, out.data_ptr())
        return out

    def qk_norm(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], normalised in place
        q_weight: torch.Tensor,  # [D]
        k_weight: torch.Tensor,  # [D]
        eps: float,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """RMSNorm of every q head (with q_weight) and k head (with k_weight) of a fused qkv, in place."""
        d = q_weight.shape[0]
        t = qkv.shape[0]
        _require_f32("qkv", qkv, (t, (num_heads + 2 * num_kv_heads) * d))
        _require_f32("q_weight", q_weight, (d,))
        _require_f32("k_weight", k_weight, (d,))
        if d % 8:
            raise ValueError(f"qk_norm: head_dim {d} is not a multiple of 8")
        if t:
            self.lib.orca_qk_norm(
                qkv.data_ptr(), t, num_heads, num_kv_heads, d, q_weight.data_ptr(), k_weight.data_ptr(), eps
            )

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H] @ weight [E, H]^T in float32, each logit one dot product in a fixed order (the same
        whatever T: a token's routing does not depend on its batch)."""
        t, h = x.shape
        e = weight.shape[0]
        _require_f32("x", x)
        _require_f32("weight", weight, (e, h))
        if h % 8:
            raise ValueError(f"router_logits: width {h} is not a multiple of 8")
        out = torch.empty(t, e, dtype=torch.float32)
        if t:
            self.lib.orca_router_logits(x.data_ptr(), t, h, weight.data_ptr(), e, out.data_ptr())
        return out

    def moe_route(
        self, logits: torch.Tensor, top_k: int, normalize: bool, softmax_first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), highest first (ties
        to the lower expert): softmax, top k, renormalised where `normalize`; or, not softmax_first,
        the top k logits and a softmax over them."""
        t, e = logits.shape
        _require_f32("logits", logits)
        if not 0 < top_k <= e:
            raise ValueError(f"moe_route: top {top_k} of {e} experts")
        weights = torch.empty(t, top_k, dtype=torch.float32)
        experts = torch.empty(t, top_k, dtype=torch.int64)
        if t:
            self.lib.orca_moe_route(
                logits.data_ptr(), t, e, top_k, int(normalize), int(softmax_first),
                weights.data_ptr(), experts.data_ptr(),
            )  # fmt: skip
        return weights, experts

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2d] (gate | up) -> [..., d] = silu(gate) * up."""
        return self._gated(x, self.lib.orca_silu_and_mul, "silu_and_mul")

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2d] (gate | up) -> [..., d] = gelu_tanh(gate) * up (Gemma's MLP)."""
        return self._gated(x, self.lib.orca_gelu_tanh_and_mul, "gelu_tanh_and_mul")

    @staticmethod
    def _gated(x: torch.Tensor, fn: Any, name: str) -> torch.Tensor:
        """A gated activation's kernel over x [..., 2d] (gate | up) -> [..., d]."""
        d = x.shape[-1] // 2
        _require_f32("x", x)
        if x.shape[-1] != 2 * d or d % 8:
            raise ValueError(f"{name}: width {x.shape[-1]} is not twice a multiple of 8")
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
        rows = x.numel() // (2 * d) if d else 0
        if rows:
            fn(x.data_ptr(), rows, d, out.data_ptr())
        return out

    def rope_and_cache(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin: torch.Tensor,  # [max_pos, R]: cos | sin of the R <= D rotated dims
        slots: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, row]: rows of D values (KV_TYPE_CODES)
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> None:
        """Rotary on q and k (in place in qkv), then k and v of every token into its cache slot, in the
        cache's element type."""
        t = qkv.shape[0]
        hkv = k_cache.shape[-2]
        d = qkv.shape[1] // (num_heads + 2 * hkv)
        _require_f32("qkv", qkv, (t, (num_heads + 2 * hkv) * d))
        _require_f32("cos_sin", cos_sin)
        kv_type = _require_caches(k_cache, v_cache, (*k_cache.shape[:-1], d))
        r = cos_sin.shape[-1]  # the rotary dims (partial rotary: fewer than head_dim)
        if r > d or r % 16 or d % 16 or tuple(positions.shape) != (t,) or tuple(slots.shape) != (t,):
            raise ValueError("rope_and_cache: head_dim, cos_sin, positions or slots do not match qkv")
        if not t:
            return
        pos = positions.to(torch.int64).contiguous()
        slot = slots.to(torch.int64).contiguous()
        self.lib.orca_rope_and_cache(
            qkv.data_ptr(),
            t,
            num_heads,
            hkv,
            d,
            r,
            pos.data_ptr(),
            cos_sin.data_ptr(),
            slot.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_type,
        )


def _checked() -> Kernels:
    k = kernels()
    if k is None:
        raise RuntimeError("the native CPU kernels are not available on this machine")
    return k


def _chosen(method: Callable[Concatenate[Kernels, P], R]) -> Callable[P, R]:
    """A module-level entry point: `method` of the variant this process uses (kernels()), which must
    be available. Callers look these up on this module at call time, so labelled_for_profiler can wrap
    them."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return method(_checked(), *args, **kwargs)

    call.__name__ = call.__qualname__ = method.__name__
    call.__doc__ = method.__doc__
    return call


quant_linear = _chosen(Kernels.quant_linear)
dequant_rows = _chosen(Kernels.dequant_rows)
paged_decode_attention = _chosen(Kernels.paged_decode_attention)
paged_prefill_attention = _chosen(Kernels.paged_prefill_attention)
rms_norm = _chosen(Kernels.rms_norm)
qk_norm = _chosen(Kernels.qk_norm)
router_logits = _chosen(Kernels.router_logits)
moe_route = _chosen(Kernels.moe_route)
silu_and_mul = _chosen(Kernels.silu_and_mul)
gelu_tanh_and_mul = _chosen(Kernels.gelu_tanh_and_mul)
rope_and_cache = _chosen(Kernels.rope_and_cache)
# The entry points above, by name (labelled_for_profiler wraps them).
NATIVE_OPS = (
    "quant_linear",
    "dequant_rows",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "qk_norm",
    "router_logits",
    "moe_route",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "rope_and_cache",
)


def supports_decode_attention(
    head_dim: int, num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype = torch.float32
) -> bool:
    """Shapes and cache types the attention kernel takes (orca_paged_decode_attention's checks)."""
    return (
        head_dim % 8 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and kv_row_width(kv_dtype, head_dim) is not None
    )


def supports_prefill_attention(
    head_dim: int, num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype = torch.float32
) -> bool:
    """Shapes and cache types the prefill attention kernel takes (orca_paged_prefill_attention's
    checks): head sizes a multiple of 16 up to 256, GQA groups of at most 256 query heads."""
    return (
        head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 256
        and kv_row_width(kv_dtype, head_dim) is not None
    )


def fits_rowwise(x: torch.Tensor, width: int) -> bool:
    """Whether the row-wise kernels take x: float32 CPU, contiguous, a width that is a multiple of 8."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and width % 8 == 0
        and available()
    )


def fits_rope_and_cache(
    qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, head_dim: int
) -> bool:
    """Whether rope_and_cache takes these: float32 qkv and table, a cache of any KV_TYPE_CODES type
    whose rows hold head_dim values."""
    return (
        fits_rowwise(qkv, head_dim)
        and head_dim % 16 == 0
        and cos_sin.shape[-1] % 16 == 0
        and cos_sin.shape[-1] <= head_dim
        and cos_sin.dtype == torch.float32
        and kv_row_width(k_cache.dtype, head_dim) == k_cache.shape[-1]
        and cos_sin.is_contiguous()
        and k_cache.is_contiguous()
    )


@contextlib.contextmanager
def labelled_for_profiler() -> Iterator[None]:
    """Name every native call in torch.profiler's tables while inside (a ctypes call is invisible to
    the profiler otherwise). Callers look the wrappers up on this module at call time, so wrapping the
    module attributes is enough; nothing is labelled outside this block, where it would cost time."""
    module = sys.modules[__name__]
    originals = {name: getattr(module, name) for name in NATIVE_OPS}

    def wrapped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"native::{name}"):
                return fn(*args, **kwargs)

        return call

    global _labelling
    try:
        for name, fn in originals.items():
            setattr(module, name, wrapped(name, fn))
        _labelling = True
        yield
    finally:
        _labelling = False
        for name, fn in originals.items():
            setattr(module, name, fn)


_labelling = False  # inside labelled_for_profiler


def labelled(name: str) -> contextlib.AbstractContextManager[Any]:
    """For the layer calls made straight into the library (the fused decode layers, a mixture of
    experts): their label in torch.profiler's tables inside labelled_for_profiler, nothing outside."""
    return torch.profiler.record_function(f"native::{name}") if _labelling else contextlib.nullcontext()


if __name__ == "__main__":
    # python -m models.kernels.cpu: build every variant into the cache (container images).
    logging.basicConfig(level=logging.INFO)
    print("built:", ", ".join(build_all()) or "nothing")
    k = kernels()
    print("this CPU runs:", k.name if k else "none")
