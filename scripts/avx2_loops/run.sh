#!/usr/bin/env bash
# The AVX2 int8 loops of docs/benchmarks.md ("Zen 3, a third session"): the ceiling that the quantized
# GEMM kernels (models/kernels/quant_linear.c) are held to, on one core of this machine.
#   bash scripts/avx2_loops/run.sh        (gcc; an AVX2 CPU; ~1 min; run it on a quiet machine)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# This machine's speed moves from run to run (a VM): each loop runs 5 times, its fastest run is printed.
best() { for _ in 1 2 3 4 5; do "$@"; done | sort -t: -k2 -g | tail -1; }
gcc -O2 "$here/clock.c" -o "$out/clock" && best "$out/clock"
for mode in 1 2 0 6 3 4 5 7; do
    gcc -O2 -mavx2 -DMODE=$mode "$here/loops.c" -o "$out/loops" && best "$out/loops"
done
for mr in 4 5; do
    gcc -O2 -mavx2 -DMR=$mr "$here/q4k_block.c" -o "$out/q4k" && best "$out/q4k"
    gcc -O2 -mavx2 -DPACKED -DMR=$mr "$here/q4k_block.c" -o "$out/q4k" && echo -n "codes unpacked in the loop, " && best "$out/q4k"
done
for cfg in "0 8" "1 4"; do
    set -- $cfg
    gcc -O2 -mavx2 -DMODE=$1 -DMR=$2 "$here/q6k_chunks.c" -o "$out/q6k" && best "$out/q6k"
done
