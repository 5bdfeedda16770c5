"""Micro-benchmark of the quantized-linear kernel: every variant this CPU runs, both precisions, next
to torch's float32 and bfloat16 matmuls on the same (dequantized) weight, interleaved and repeated.

    python -m engine.kernel_bench [--rows 1,8,32,64,512] [--shape 3072x576] [--format Q4_1]

Prints, per number of rows of x, the median time of each path and what it reached: GB/s of weight
bytes read (the bound at few rows) and GFLOP/s (at many). Interleaving the paths round by round keeps
the ratios meaningful on a shared machine where absolute figures move.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.kernels import cpu as cpu_kernels
from models.kernels.isa import cpu_flags, supported_variants
from models.layers.packed_weight import FORMATS, PackedWeight, pack_components, random_components

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def _time(fn: Callable[[], object], clock: Callable[[], float], min_s: float = 0.02) -> float:
    """Seconds per call: the mean over enough calls to fill min_s (one round)."""
    fn()
    n, start = 0, clock()
    while True:
        fn()
        n += 1
        elapsed = clock() - start
        if elapsed >= min_s:
            return elapsed / n


def _paths(
    x: torch.Tensor, packed: PackedWeight, w: torch.Tensor, wb: torch.Tensor
) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one call, weight bytes it reads)."""
    paths: dict[str, tuple[Callable[[], object], int]] = {}
    for v in supported_variants():
        kern = cpu_kernels.for_variant(v.name)
        for prec in ("int8", "float32"):
            paths[f"{v.name}/{prec}"] = (
                lambda kern=kern, prec=prec: kern.quant_linear(x, packed, prec),
                packed.nbytes,
            )
    xb = x.bfloat16()
    paths["torch f32"] = (lambda: F.linear(x, w), w.numel() * 4)
    paths["torch bf16"] = (lambda: F.linear(xb, wb), w.numel() * 2)
    return paths


def run(rows: list[int], n: int, k: int, fmt: str, rounds: int, threads: int) -> None:
    torch.set_num_threads(threads)  # torch's pool and the kernels' OpenMP regions alike
    # One thread: this thread's CPU time, which other processes on a shared machine barely move.
    clock = time.thread_time if threads == 1 else time.perf_counter
    packed = PackedWeight((pack_components(random_components(FORMATS[fmt], n, k)),))
    w = packed.dequantize()
    wb = w.bfloat16()
    print(
        f"W {n}x{k} {fmt}: {packed.nbytes / 1e6:.2f} MB packed ({8 * packed.nbytes / (n * k):.2f} bits/weight)"
    )
    print(
        "CPU flags:",
        " ".join(f for f in ISA_FLAGS if f in cpu_flags()),
        f"| threads {threads}",
        "(CPU time)" if threads == 1 else "(wall time)",
    )
    for m in rows:
        paths = _paths(torch.randn(m, k), packed, w, wb)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, (fn, _) in paths.items():
                times[name].append(_time(fn, clock))
        flops = 2 * m * n * k
        print(f"\nrows {m}:  {'path':24s} {'us':>9s} {'GB/s':>7s} {'GFLOP/s':>8s}")
        for name, (_, nbytes) in paths.items():
            t = statistics.median(times[name])
            print(f"          {name:24s} {t * 1e6:9.1f} {nbytes / t / 1e9:7.1f} {flops / t / 1e9:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64,512")
    p.add_argument("--shape", default="3072x576", help="N x K of the weight (default: SmolLM2's gate/up)")
    p.add_argument("--format", default="Q4_1", choices=list(FORMATS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="1: timed in CPU time")
    a = p.parse_args()
    n, k = (int(v) for v in a.shape.lower().split("x"))
    run([int(r) for r in a.rows.split(",")], n, k, a.format, a.rounds, a.threads)


if __name__ == "__main__":
    main()
