#!/usr/bin/env bash
# The AVX2 int8 loops of docs/benchmarks.md ("Zen 3, a third session"): the ceiling that the quantized
# GEMM kernels (models/kernels/quant_linear.c) are held to, on each core of this machine.
#   bash scripts/avx2_loops/run.sh        (gcc, taskset; an AVX2 CPU; ~1 min a core; a quiet machine)
# Each loop runs pinned to each CPU in turn: on a VM the vCPUs need not be equal (a 2-vCPU Zen 3 ran the
# Q4_K-shaped loop at 3.9 G products a second on one and 2.85 G on the other, at the same clock, for
# minutes, then both at 4.0 G: docs/benchmarks.md, "Zen 3, a fourth session"), so a loop left to the
# scheduler reads as either.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# This machine's speed moves from run to run (a VM): each loop runs 5 times, its fastest run is printed.
best() { for _ in 1 2 3 4 5; do "$@"; done | sort -t: -k2 -g | tail -1; }
on() { local cpu=$1; shift; best taskset -c "$cpu" "$@"; } # on CPU PROGRAM: pinned, the fastest of 5
build() { local name=$1; shift; gcc -O2 "$@" -o "$out/$name"; }
build clock "$here/clock.c"
for mode in 1 2 0 6 3 4 5 7; do build "loops$mode" -mavx2 -DMODE=$mode "$here/loops.c"; done
for mr in 4 5; do
    build "q4k$mr" -mavx2 -DMR=$mr "$here/q4k_block.c"
    build "q4k_packed$mr" -mavx2 -DPACKED -DMR=$mr "$here/q4k_block.c"
done
build q6k8 -mavx2 -DMODE=0 -DMR=8 "$here/q6k_chunks.c"
build q6k4 -mavx2 -DMODE=1 -DMR=4 "$here/q6k_chunks.c"
for cpu in $(seq 0 $(($(nproc) - 1))); do
    echo "== cpu $cpu"
    on "$cpu" "$out/clock"
    for mode in 1 2 0 6 3 4 5 7; do on "$cpu" "$out/loops$mode"; done
    for mr in 4 5; do
        on "$cpu" "$out/q4k$mr"
        echo -n "codes unpacked in the loop, " && on "$cpu" "$out/q4k_packed$mr"
    done
    on "$cpu" "$out/q6k8"
    on "$cpu" "$out/q6k4"
done
