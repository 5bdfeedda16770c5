"""Marks for tests that need the native CPU kernels (models/kernels/cpu.py). Without AVX2/FMA or a C
compiler the kernels are not built, the code falls back to torch ops, and these tests are skipped."""

from __future__ import annotations

import pytest

from models.kernels import cpu as cpu_kernels

needs_native_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels not built here (no AVX2/FMA or no C compiler)"
)
