"""The group-int8 CPU matmul (group_int8_gemm.c): build once, load, call.

The C file is compiled on first use with the system C compiler (`cc`, AVX2 + FMA + OpenMP) into the
orca-serve cache, under a name keyed by the source's hash, so an edited kernel is rebuilt and a
finished build is reused by every later process. Plain C and ctypes rather than a torch C++ extension:
the build takes about a second instead of a minute of compiling torch headers, and needs no ninja.

Everything here degrades to "not available" (callers keep their float32 weights): a CPU without
AVX2/FMA, no compiler, a failed build. The reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from models.gguf_convert import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("group_int8_gemm.c")
GROUP_SIZE = 32  # columns of W sharing one scale and zero (GGUF's block size)
REQUIRED_CPU_FLAGS = ("avx2", "fma")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
DISABLE_ENV = "ORCA_DISABLE_NATIVE_KERNELS"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
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
        log.info("group-int8 kernel unavailable: this CPU lacks %s", ", ".join(missing))
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"group_int8_gemm-{digest}.so"
    try:
        if not target.is_file():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("group-int8 kernel unavailable (weights stay float32): %s", e)
        return None
    fn = lib.orca_group_int8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
    fn.argtypes += [ctypes.c_int64, ctypes.c_void_p]
    return lib


def available() -> bool:
    return _library() is not None


def group_int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x [..., K] float32 @ W^T with W[n, k] = scales[n, k // 32] * codes[n, k] + zeros[n, k // 32].

    codes [N, K] int8, scales and zeros [N, K // 32] float32, all contiguous CPU tensors.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the group-int8 kernel is not available on this machine")
    n, k = codes.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        rc = lib.orca_group_int8_linear(
            x2.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, y.data_ptr()
        )
        if rc:
            raise ValueError(f"group-int8 linear: bad shapes x {tuple(x2.shape)}, codes {(n, k)}")
    return y.view(*lead, n)
