"""engine.kernel_ab: a library built from a copy of the kernel sources (cpu.for_sources) with its own
compiler flags computes what the installed one does, and the A/B reports both sides and whether their
outputs are identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import kernel_ab
from models.kernels import cpu as cpu_kernels
from tests.kernel_marks import kernels_for, needs_native_kernels

KERNEL_SOURCES = Path(cpu_kernels.__file__).parent


# Slow: compiling a second kernel tree takes ~30 s on a 2-core machine, the largest single cost of `make
# test` (2026-12-02), for a benchmarking tool rather than the server.
@pytest.mark.slow
@needs_native_kernels
def test_a_tree_with_other_flags_matches_the_installed_kernels() -> None:
    installed = kernels_for("avx2")
    # A prefetch setting changes no result: the two sides must come out identical, row count by row count.
    other = cpu_kernels.for_sources(
        KERNEL_SOURCES, "avx2", ["-DPREFETCH_MIN_ROWS=1", "-DPREFETCH_AHEAD=1024"]
    )
    results = kernel_ab.run([installed, other], "Q4_K", 32, 512, [1, 3], rounds=2, copies=2, slice_s=0.001)
    assert [(m, same) for m, _, _, same in results] == [(1, True), (3, True)]
    assert all(ta > 0 and tb > 0 for _, ta, tb, _ in results)


@needs_native_kernels
def test_sources_without_kernels_are_refused(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="no kernel sources"):
        cpu_kernels.for_sources(tmp_path, "avx2")
