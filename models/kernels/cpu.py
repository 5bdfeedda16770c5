"""The native CPU kernels: build once, load, call.

    group_int8_gemm.c         y = x @ W^T for group-int8 packed weights (models/layers/packed_weight.py)
    paged_decode_attention.c  one-token-per-sequence attention read in place from the paged KV cache
    elementwise.c             RMSNorm (with the residual add fused in), SiLU-and-mul, and rotary + KV cache
                              write, one call each
    simd.h                    their shared AVX2 helpers (exp, horizontal sums)

The C files are compiled together on first use with the system C compiler (`cc`, AVX2 + FMA + OpenMP)
into one library in the orca-serve cache, named by a hash of the sources and flags, so an edited kernel
is rebuilt and a finished build is reused by every later process. Plain C and ctypes rather than a
torch C++ extension: the build takes about two seconds instead of a minute of compiling torch headers,
and needs no ninja. ctypes releases the GIL during a call; OpenMP in the library resolves to torch's own
libgomp (already loaded), so the kernels and torch share one thread pool.

Everything here degrades to "not available" (callers keep their torch paths): a CPU without AVX2/FMA,
no compiler, a failed build, or ORCA_DISABLE_NATIVE_KERNELS=1. The reason is logged once.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from models.gguf_convert import cache_root

if TYPE_CHECKING:
    from models.layers.packed_weight import PackedWeight

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
REQUIRED_CPU_FLAGS = ("avx2", "fma")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
DISABLE_ENV = "ORCA_DISABLE_NATIVE_KERNELS"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: macOS, Windows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, *LIBS],
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


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV):
        log.info("native kernels disabled by %s", DISABLE_ENV)
        return None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        log.info("native CPU kernels unavailable: this CPU lacks %s", ", ".join(missing))
        return None
    sources = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join(CFLAGS).encode())
    target = cache_root() / "kernels" / f"orca_cpu_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable (torch paths are used instead): %s", e)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.orca_group_int8_linear.restype = ctypes.c_int
    lib.orca_group_int8_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.orca_paged_decode_attention.restype = ctypes.c_int
    lib.orca_paged_decode_attention.argtypes = [ptr] * 5 + [i64] * 6 + [ctypes.c_float, ptr]
    lib.orca_rms_norm.restype = None
    lib.orca_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr]
    lib.orca_silu_and_mul.restype = None
    lib.orca_silu_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.orca_rope_and_cache.restype = None
    lib.orca_rope_and_cache.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    return lib


def available() -> bool:
    return _library() is not None


def _require_f32(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """The C code trusts its pointers: a wrong dtype, layout or shape would read out of bounds, so it
    is refused here (metadata-only checks, no pass over the data). Index contents (block tables,
    positions, slots) are the engine's to validate, which build_step_inputs does for every step."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def _checked_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available on this machine")
    return lib


def group_int8_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., K] float32 @ W^T for a packed weight (validated when it was built)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    _require_f32("x", x2)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        rc = _checked_library().orca_group_int8_linear(
            x2.data_ptr(), m, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), n, y.data_ptr()
        )
        if rc:
            raise ValueError(f"group-int8 linear: bad shapes x {tuple(x2.shape)}, codes {(n, k)}")
    return y.view(*lead, n)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[n, Hq, D] attention of one query token per sequence over its whole cached history.

    q [n, Hq, D] float32; caches [num_blocks, block_size, Hkv, D] float32; block_tables [n, max_blocks]
    and seq_lens [n] int32. Sequence i's token t is at block block_tables[i, t // block_size].
    """
    n, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    q = q.contiguous()
    _require_f32("q", q)
    _require_f32("k_cache", k_cache, (num_blocks, block_size, hkv, d))
    _require_f32("v_cache", v_cache, (num_blocks, block_size, hkv, d))
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] != n or tuple(lens.shape) != (n,):
        raise ValueError(
            f"block_tables {tuple(tables.shape)} / seq_lens {tuple(lens.shape)} do not match {n} queries"
        )
    out = torch.empty_like(q)
    rc = _checked_library().orca_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        n,
        hq,
        hkv,
        d,
        block_size,
        tables.shape[1],
        scale,
        out.data_ptr(),
    )
    if rc:
        raise ValueError(
            f"paged decode attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    return out


def supports_decode_attention(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Shapes the attention kernel takes (orca_paged_decode_attention's checks)."""
    return head_dim % 8 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0


def fits_rowwise(x: torch.Tensor, width: int) -> bool:
    """Whether the row-wise kernels take x: float32 CPU, contiguous, a width that is a multiple of 8."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and width % 8 == 0
        and available()
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x / rms(x) * weight over the last dim. With `residual`, x + residual is normalised and also
    written into `residual` (in place: the caller's next residual stream), as vLLM's fused_add_rms_norm."""
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
        _checked_library().orca_rms_norm(
            x.data_ptr(), res_ptr, weight.data_ptr(), eps, rows, h, out.data_ptr()
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] (gate | up) -> [..., d] = silu(gate) * up."""
    d = x.shape[-1] // 2
    _require_f32("x", x)
    if x.shape[-1] != 2 * d or d % 8:
        raise ValueError(f"silu_and_mul: width {x.shape[-1]} is not twice a multiple of 8")
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rows = x.numel() // (2 * d) if d else 0
    if rows:
        _checked_library().orca_silu_and_mul(x.data_ptr(), rows, d, out.data_ptr())
    return out


def fits_rope_and_cache(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor) -> bool:
    head_dim = k_cache.shape[-1]
    return (
        fits_rowwise(qkv, head_dim)
        and head_dim % 16 == 0
        and cos_sin.dtype == k_cache.dtype == torch.float32
        and cos_sin.is_contiguous()
        and k_cache.is_contiguous()
    )


def rope_and_cache(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], rotated in place
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_pos, D]: cos | sin
    slots: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    num_heads: int,
) -> None:
    """Rotary on q and k (in place in qkv), then k and v of every token into its cache slot."""
    t = qkv.shape[0]
    hkv, d = k_cache.shape[-2:]
    _require_f32("qkv", qkv, (t, (num_heads + 2 * hkv) * d))
    _require_f32("cos_sin", cos_sin)
    _require_f32("k_cache", k_cache)
    _require_f32("v_cache", v_cache, tuple(k_cache.shape))
    if cos_sin.shape[-1] != d or d % 16 or tuple(positions.shape) != (t,) or tuple(slots.shape) != (t,):
        raise ValueError("rope_and_cache: head_dim, cos_sin, positions or slots do not match qkv")
    if not t:
        return
    pos = positions.to(torch.int64).contiguous()
    slot = slots.to(torch.int64).contiguous()
    _checked_library().orca_rope_and_cache(
        qkv.data_ptr(),
        t,
        num_heads,
        hkv,
        d,
        pos.data_ptr(),
        cos_sin.data_ptr(),
        slot.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    )


NATIVE_OPS = ("group_int8_linear", "paged_decode_attention", "rms_norm", "silu_and_mul", "rope_and_cache")


@contextlib.contextmanager
def labelled_for_profiler() -> Iterator[None]:
    """Name every native call in torch.profiler's tables while inside (a ctypes call is invisible to
    the profiler otherwise). Callers look the wrappers up on this module at call time, so wrapping the
    module attributes is enough; nothing is labelled outside this block, where it would cost time."""
    module = sys.modules[__name__]
    originals = {name: getattr(module, name) for name in NATIVE_OPS}

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"native::{name}"):
                return fn(*args, **kwargs)

        return call

    try:
        for name, fn in originals.items():
            setattr(module, name, labelled(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
