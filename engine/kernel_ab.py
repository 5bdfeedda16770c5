"""In-process A/B of two builds of the CPU kernels: which one runs the quantized linear faster, and
whether their outputs are identical (a kernel change must not change a bit).

    python -m engine.kernel_ab A_DIR B_DIR [--cflags-b="-DPREFETCH_MIN_ROWS=1"] [--format Q4_K]
        [--shape 2048x8192] [--rows 1,8,32,128] [--rounds 20] [--copies 1] [--variant avx2]

A_DIR and B_DIR hold kernel sources (models/kernels, or a copy of it from another commit: `git worktree
add /tmp/a <commit>` and /tmp/a/models/kernels); one directory twice with different --cflags-a/-b
compares compile-time settings. Both libraries are built now and loaded into this one process, and are
timed round by round in turn, so a shared machine's drift falls on both alike. Each figure is the
fastest round: on the 2-vCPU VMs this project measures on, a whole round can run at half speed when
the host takes a vCPU away, which a median still feels. --copies rotates the weights through that
many copies, so that at few rows they come from memory rather than from the cache.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from engine.kernel_bench import ISA_FLAGS, _time
from models.kernels import cpu as cpu_kernels
from models.kernels.isa import VARIANT_NAMES, cpu_flags
from models.layers.packed_weight import FORMATS, PackedWeight, pack_components, random_components


def run(
    sides: list[cpu_kernels.Kernels],
    fmt: str,
    n: int,
    k: int,
    rows: list[int],
    rounds: int,
    copies: int,
    slice_s: float,
) -> list[tuple[int, float, float, bool]]:
    """(rows, A's seconds, B's seconds, outputs identical) for each row count."""
    weights = [PackedWeight((pack_components(random_components(FORMATS[fmt], n, k)),)) for _ in range(copies)]
    results = []
    for m in rows:
        x = torch.randn(m, k)
        identical = torch.equal(*(side.quant_linear(x, weights[0]) for side in sides))
        turns = itertools.cycle(weights)
        calls = [lambda side=side, x=x, turns=turns: side.quant_linear(x, next(turns)) for side in sides]
        for call in calls:  # a round each, untimed: the first side would otherwise warm the caches for both
            _time(call, time.perf_counter, slice_s)
        best = [float("inf")] * len(calls)
        for _ in range(rounds):  # interleaved, round by round
            best = [
                min(b, _time(call, time.perf_counter, slice_s)) for b, call in zip(best, calls, strict=True)
            ]
        results.append((m, best[0], best[1], identical))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="kernel sources of side A")
    p.add_argument("b", type=Path, help="kernel sources of side B")
    p.add_argument("--cflags-a", default="", help="extra compiler flags of side A (write --cflags-a=...)")
    p.add_argument("--cflags-b", default="", help="extra compiler flags of side B (write --cflags-b=...)")
    p.add_argument("--variant", default="avx2", choices=VARIANT_NAMES)
    p.add_argument("--format", default="Q4_K", choices=list(FORMATS))
    p.add_argument("--shape", default="2048x8192", help="N x K of the weight")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--copies", type=int, default=1, help="weights rotating through this many copies")
    p.add_argument("--slice", type=float, default=0.04, help="seconds of calls a round times")
    a = p.parse_args(argv)
    n, k = (int(v) for v in a.shape.lower().split("x"))
    sides = [
        cpu_kernels.for_sources(a.a, a.variant, a.cflags_a.split()),
        cpu_kernels.for_sources(a.b, a.variant, a.cflags_b.split()),
    ]
    flags = " ".join(f for f in ISA_FLAGS if f in cpu_flags())
    print(f"{a.format} {n}x{k} x {a.copies} copies, {a.variant} kernels, CPU flags: {flags}")
    for m, ta, tb, same in run(
        sides, a.format, n, k, [int(r) for r in a.rows.split(",")], a.rounds, a.copies, a.slice
    ):
        gops = 2 * m * n * k / 1e9
        print(
            f"rows {m:4d}: A {ta * 1e6:9.1f} us ({gops / ta:6.1f} GOP/s)  B {tb * 1e6:9.1f} us "
            f"({gops / tb:6.1f})  B's speed-up {ta / tb:.3f}x  identical={same}"
        )


if __name__ == "__main__":
    main()
