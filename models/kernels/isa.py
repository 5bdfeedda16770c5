"""Which build of the native kernels this CPU runs: the ISA variants and the choice between them.

Every kernel is compiled once per variant, each into its own library with its own -m flags, so a
machine only ever loads (and executes) the instructions its CPU has: an AVX2-only CI box never sees an
AVX-512 instruction. The variants are nested, each needing everything the previous one needs:

    avx2         AVX2 + FMA + F16C: the baseline (Haswell, Zen 1 and later); int8 dot products by
                 vpmaddubsw, as llama.cpp's AVX2 path
    avx512       + AVX-512 F/BW/VL/DQ: 512-bit vectors (Skylake-X)
    avx512_vnni  + AVX512-VNNI: vpdpbusd, one instruction per 64 int8 products (Ice Lake, Zen 4)
    amx          + AMX-TILE/AMX-INT8: tile matrix multiply for prompts and large batches (Sapphire
                 Rapids); needs the kernel's permission (arch_prctl), asked for at load

The best variant the CPU supports is chosen from /proc/cpuinfo; ORCA_CPU_KERNELS=<name> forces one
(tests, comparisons) and ORCA_CPU_KERNELS=off turns the native kernels off.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

VARIANT_ENV = "ORCA_CPU_KERNELS"
DISABLE_ENV = "ORCA_DISABLE_NATIVE_KERNELS"  # older switch, same as ORCA_CPU_KERNELS=off


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


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: tuple[str, ...]  # all of them must be in /proc/cpuinfo's flags
    cflags: tuple[str, ...]  # the compiler's -m flags for this build
    description: str

    def supported(self, flags: frozenset[str] | None = None) -> bool:
        return set(self.cpu_flags) <= (cpu_flags() if flags is None else flags)


_AVX2 = Variant("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "AVX2+FMA")
_AVX512 = Variant(
    "avx512",
    (*_AVX2.cpu_flags, "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    (*_AVX2.cflags, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "AVX-512 F/BW/VL/DQ",
)
_VNNI = Variant(
    "avx512_vnni",
    (*_AVX512.cpu_flags, "avx512_vnni"),
    (*_AVX512.cflags, "-mavx512vnni"),
    "AVX-512 + VNNI",
)
_AMX = Variant(
    "amx",
    (*_VNNI.cpu_flags, "amx_tile", "amx_int8"),
    (*_VNNI.cflags, "-mamx-tile", "-mamx-int8"),
    "AVX-512 + VNNI + AMX-INT8",
)
VARIANTS: tuple[Variant, ...] = (_AVX2, _AVX512, _VNNI, _AMX)  # worst to best
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant_named(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown CPU kernel variant {name!r}; one of {', '.join(VARIANT_NAMES)} or 'off'")


def supported_variants(flags: frozenset[str] | None = None) -> list[Variant]:
    return [v for v in VARIANTS if v.supported(flags)]


def requested_variant() -> tuple[Variant | None, str]:
    """(the variant to load, why): the forced one, the best supported one, or None and the reason."""
    if os.environ.get(DISABLE_ENV):
        return None, f"disabled by {DISABLE_ENV}"
    forced = os.environ.get(VARIANT_ENV, "").strip().lower()
    if forced in ("off", "none", "0"):
        return None, f"disabled by {VARIANT_ENV}={forced}"
    if forced and forced != "auto":
        v = variant_named(forced)
        if not v.supported():
            missing = sorted(set(v.cpu_flags) - cpu_flags())
            return None, f"{VARIANT_ENV}={forced}, but this CPU lacks {', '.join(missing)}"
        return v, f"forced by {VARIANT_ENV}"
    supported = supported_variants()
    if not supported:
        if not cpu_flags():
            # No /proc/cpuinfo (macOS, Windows): torch's own dispatch level says whether AVX2 is there.
            if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX"):
                return _AVX2, "no /proc/cpuinfo; torch reports AVX2"
            return None, "no /proc/cpuinfo and torch reports no AVX2"
        missing = sorted(set(_AVX2.cpu_flags) - cpu_flags())
        return None, f"this CPU lacks {', '.join(missing)}"
    return supported[-1], "the best this CPU supports"
