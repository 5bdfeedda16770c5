#!/usr/bin/env bash
# This checkout against an earlier commit on the same GPU, in one device call: engine.bench decode
# throughput per shape and batch, the two trees alternating (a lent machine's speed drifts, and a
# second call may land on another card), then each batch's ratio.
#
#   bash scripts/gpu_ab.sh prepare BASE      # here: BASE's tree into .gpu-ab/base (git-ignored)
#   bash scripts/gpu_ab.sh run               # on the device, `carry: [".whl", ".gpu-assets", ".gpu-ab"]`
#
# run takes SHAPES (engine/model_shapes.py names, default "gemma-3-1b qwen3-8b"), BATCHES (default
# 1,16,64), ROUNDS (default 2) and LIMIT (seconds per engine.bench, default 90); it writes
# $OUT/ab-<tree>-<shape>-<round>.json and prints the table. MODE=tpot runs loadtest.tpot instead (TPOT
# at CONCURRENCY streams, default 1, through the iteration loop, overlap off and on, against the bare
# step; random bf16 weights at each shape) and prints each tree's TPOT / bare step (#28 item 2). The base runs from its own tree (its
# PYTHONPATH first), the current one from this checkout; wheels and tokenizer as gpu_check.sh takes them.
# A rehearsal on a CPU: PYTHON=.venv/bin/python DEVICE=cpu TINY=1 OUT=/tmp/ab bash scripts/gpu_ab.sh run
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

prepare() {
    local base=$1
    rm -rf .gpu-ab && mkdir -p .gpu-ab/base
    git archive "$base" | tar -x -C .gpu-ab/base
    git rev-parse "$base" >.gpu-ab/base-commit
    du -sh .gpu-ab
}

run() {
    local out=${OUT:-$ROOT/gpu-check-out} py=${PYTHON:-python3} shape round tree
    [[ $py != */* || $py == /* ]] || py=$ROOT/$py  # the base runs from its own folder
    mkdir -p "$out"
    if [ -z "${TINY:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then  # a rehearsal runs the local environment
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONUNBUFFERED=1 ORCA_TEST_CACHE=$ROOT/.gpu-assets/test-cache
    echo "base $(cat .gpu-ab/base-commit 2>/dev/null || echo '?') against this checkout"
    if [ "${MODE:-decode}" = tpot ]; then
        for shape in ${SHAPES:-smollm2-135m gemma-3-1b}; do
            "$py" -c "import sys; from engine.model_shapes import write_shape; write_shape(sys.argv[1], sys.argv[2], bool(sys.argv[3]))" \
                "$shape" "$out/shapes/$shape" "${TINY:-}"
        done
    fi
    for round in $(seq "${ROUNDS:-2}"); do
        for shape in ${SHAPES:-gemma-3-1b qwen3-8b}; do
            for tree in current base; do
                local dir=$ROOT
                [ $tree = current ] || dir=$ROOT/.gpu-ab/base
                if [ "${MODE:-decode}" = tpot ]; then
                    (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout "${LIMIT:-150}" "$py" -m loadtest.tpot \
                        --model "$out/shapes/$shape" --load-format dummy --device "${DEVICE:-cuda}" \
                        --dtype "${DTYPE:-bfloat16}" --concurrency "${CONCURRENCY:-1}" --new-tokens "${NEW_TOKENS:-128}" \
                        --repeats 3 --json "$out/tpot-$tree-$shape-$round.json" \
                        >"$out/tpot-$tree-$shape-$round.log" 2>&1) || echo "$tree $shape round $round failed"
                    continue
                fi
                (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout "${LIMIT:-90}" "$py" -m engine.bench \
                    --device "${DEVICE:-cuda}" ${TINY:+--tiny} --shape "$shape" --batch-sizes "${BATCHES:-1,16,64}" --new-tokens 32 \
                    --prompt-len 64 --skip-hf --prefill-lens "" --json "$out/ab-$tree-$shape-$round.json" \
                    >"$out/ab-$tree-$shape-$round.log" 2>&1) || echo "$tree $shape round $round failed"
            done
        done
    done
    if [ "${MODE:-decode}" = tpot ]; then
        "$py" - "$out" <<'PY'
import json, pathlib, sys
print(f"{'shape':14} {'tree':8} {'round':>5} {'bare ms':>8} {'off ms':>8} {'on ms':>8} {'off/bare':>9} {'on/bare':>8}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("tpot-*.json")):
    tree, rest = f.stem[5:].split("-", 1)
    shape, rnd = rest.rsplit("-", 1)
    rows = {r["label"].split(",")[-1].strip(): r for r in json.loads(f.read_text())}
    bare, off, on = (rows.get(k, {}) for k in ("bare step (engine.bench)", "--overlap-schedule off", "--overlap-schedule on"))
    ms = lambda r: f"{r['tpot_ms']:8.3f}" if r else "       -"  # noqa: E731
    ratio = lambda r: f"{r['ratio']:8.3f}" if r else "       -"  # noqa: E731
    print(f"{shape:14} {tree:8} {rnd:>5} {ms(bare)} {ms(off)} {ms(on)} {ratio(off):>9} {ratio(on)}")
PY
        return
    fi
    "$py" - "$out" <<'PY'
import json, pathlib, statistics, sys
from collections import defaultdict
tok = defaultdict(list)  # (shape, batch, tree) -> tok/s of each round
for f in sorted(pathlib.Path(sys.argv[1]).glob("ab-*.json")):
    tree, rest = f.stem[3:].split("-", 1)
    shape = rest.rsplit("-", 1)[0]
    for row in json.loads(f.read_text())["rows"]:
        tok[shape, row["batch_size"], tree].append(row["engine"]["decode_tok_s"])
print(f"{'shape':14} {'batch':>5} {'base tok/s':>24} {'current tok/s':>24} {'current/base':>12}")
for shape, batch in sorted({(s, b) for s, b, _ in tok}):
    base, cur = tok[shape, batch, "base"], tok[shape, batch, "current"]
    ratio = statistics.median(cur) / statistics.median(base) if base and cur else float("nan")
    show = lambda xs: ", ".join(f"{x:,.1f}" for x in xs) or "-"  # noqa: E731
    print(f"{shape:14} {batch:5} {show(base):>24} {show(cur):>24} {ratio:11.2f}x")
PY
}

case ${1:-} in
    prepare) prepare "${2:?which commit}" ;;
    run) run ;;
    *) echo "usage: $0 prepare BASE | run" >&2; exit 2 ;;
esac
