#!/usr/bin/env bash
# Issue #16's measurements on a CUDA machine (made for the lent H100: python3 with torch + triton, no
# network), in phases that each fit one 10-minute device command (their commands' limits add up to at
# most 9.5 minutes; expected: about half that):
#
#   bash scripts/gpu_check.sh env tests   # versions, imports, the cuda tests, the Triton tests compiled
#   bash scripts/gpu_check.sh bench       # engine.bench: default model's shape and Llama-3-8B's, graphs
#                                         # on/off, HF, roofline, prefill; batch-1 profiles
#   bash scripts/gpu_check.sh http        # the full experiment of docs/benchmarks.md, shortened
#   bash scripts/gpu_check.sh profile     # one server under load: per-step times, py-spy of its threads
#                                         # (PROFILE_NATIVE=1: with C frames, i.e. the GIL waits)
#   bash scripts/gpu_check.sh tpot        # issue #28 item 2: TPOT at one stream through the iteration
#                                         # loop against the bare step, overlap off and on, per shape
#
# With no phase named it runs them all in turn. Before: scripts/gpu_prepare.sh on a machine with the
# network fills .whl/ (wheels the GPU image lacks) and .gpu-assets/ (the tokenizer); carry both.
# Each phase writes $OUT/<phase>.log and, where it has results, $OUT/<phase>.tar.gz (7 files at most, no
# sub-folders; OUT defaults to gpu-check-out/). Every command has its own time limit, and results are
# packed after each, so a phase cut short still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
ASSETS=$ROOT/.gpu-assets
TOKENIZER=$ASSETS/test-cache/smollm2-tokenizer
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
    # A rehearsal of every command on a CPU (PYTHON=.venv/bin/python GPU_CHECK_DRY=1 bash scripts/gpu_check.sh):
    # toy shapes, a few requests, the local environment instead of the carried wheels.
    DEVICE=cpu BATCHES=1,2 RATES=1 MORE_RATES=1 REQUESTS=3 KV_MEMORY=512MiB
    BENCH=(--tiny --new-tokens 4 --prefill-lens 16 --prefill-tokens 32 --bandwidth-bytes 1000000)
    LOADTEST=(--input-len-max 48 --output-len-max 6)
else
    DEVICE=cuda BATCHES=${BATCHES:-1,2,4,8,16,32,64,128,256} RATES=${RATES:-4,16,64,256}
    MORE_RATES=${MORE_RATES:-16,64} REQUESTS=${REQUESTS:-100}
    KV_MEMORY=8GiB
    BENCH=()
    LOADTEST=()
fi
export PYTHONUNBUFFERED=1
export ORCA_TEST_CACHE=$ASSETS/test-cache  # the tests find the tokenizer there (no GGUF needed)
export ORCA_CACHE_DIR=$WORK/cache
# The image's own pytest plugins (xdist, cov, benchmark, ...) may not fit the carried pytest.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PYTEST=("$PY" -m pytest -p pytest_asyncio.plugin -p pytest_timeout -p no:cacheprovider -q -rs)
mkdir -p "$OUT"

log() { echo "== $(date -u +%H:%M:%S) $*"; }

# run SECONDS CMD...: the command under a time limit; a failure is logged, and the phase goes on.
run() {
    local limit=$1
    shift
    log "$*"
    # SIGINT, not SIGTERM: Python unwinds (pytest prints its summary, the load test stops its servers).
    timeout --signal=INT --kill-after=30 "$limit" "$@"
    local rc=$?
    [ $rc -eq 0 ] || log "exit $rc (124: over its ${limit}s limit)"
    return 0
}

# pack PHASE: its results so far into $OUT/PHASE.tar.gz (after every command, so that a phase cut off by
# the device's own limit still returns what it measured).
pack() {
    tar czf "$OUT/$1.tar.gz" -C "$WORK" "$1"
}

setup_python() {
    if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
        return 0
    elif ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { log "installing the carried wheels failed"; exit 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    else
        log "no .whl/: run scripts/gpu_prepare.sh where there is a network and carry .whl and .gpu-assets"
    fi
    [ -f "$TOKENIZER/tokenizer.json" ] || log "no tokenizer in $TOKENIZER (scripts/gpu_prepare.sh)"
}

phase_env() {
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
    uname -a
    "$PY" - <<'PY'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
else:
    print("NO CUDA DEVICE")
import triton
print("triton", triton.__version__)
for name in ("transformers", "tokenizers", "fastapi", "uvicorn", "pydantic", "sse_starlette", "llguidance",
             "pytest", "pytest_asyncio", "httpx", "numpy"):
    module = importlib.import_module(name)
    print(f"{name:14} {getattr(module, '__version__', '?'):12} {module.__file__}")
import server.app, engine.executor, loadtest.cli  # noqa: E401,F401  the project imports here
from models.layers.attention import auto_backend_name, available_backends
print("attention backends", available_backends("cuda"), "auto:", auto_backend_name("cuda"))
PY
}

phase_tests() {
    # Every cuda-marked test (CUDA graphs: tokens equal to eager, one synchronisation per step, the capture
    # log line, a mixture of experts captured; the CUDA backends against sdpa), then the Triton attention
    # and fused-experts tests, which compile their kernels here instead of interpreting them, and the
    # graph tests' CPU-side checks.
    # Only the files that hold cuda tests are collected: the rest of the suite imports the SDKs (openai,
    # anthropic, agents) the GPU image lacks.
    local files
    files=${CUDA_TEST_FILES:-$(grep -l -r "pytest.mark.cuda" tests --include="test_*.py" | sort | tr '\n' ' ')}
    # A limit of 0 skips that half (a short lease that only needs the Triton kernels compiled).
    [ "${CUDA_TESTS_LIMIT:-270}" = 0 ] ||
        run "${CUDA_TESTS_LIMIT:-270}" "${PYTEST[@]}" -m "cuda and not slow" $files --junitxml="$OUT/tests.xml" -s
    [ "${TRITON_TESTS_LIMIT:-210}" = 0 ] ||
        run "${TRITON_TESTS_LIMIT:-210}" "${PYTEST[@]}" -m "not cuda and not slow" ${TRITON_TEST_FILES:-tests/models/test_triton_attention.py \
            tests/models/test_triton_moe.py tests/models/test_triton_fused.py tests/engine/test_cuda_graphs.py}
}

# The shapes the bench phase runs (BENCH_SHAPES, default three of engine/model_shapes.py's; BENCH_LIMIT
# seconds each, BENCH_ARGS more engine.bench flags), whether it compares the fused small ops off and on
# (FUSED_AB=0: no) and whether it profiles (PROFILES=0: no), so that a short device lease can split the
# phase over two calls.
BENCH_SHAPES=${BENCH_SHAPES-smollm2-135m llama3-8b olmoe-1b-7b}  # set and empty: none
PROFILES=${PROFILES:-1}

phase_bench() {
    local r=$WORK/bench shape
    mkdir -p "$r"
    for shape in $BENCH_SHAPES; do
        # smollm2-135m: the default model's shape (random weights: the GGUF file does not travel), graphs
        # on and off, HF. llama3-8b: an 8B-class model, 16 GB of bf16 weights (and HF's copy beside them).
        # olmoe-1b-7b: a mixture of experts (14 GB of bf16 weights, 1.3B active), its experts in the fused
        # Triton kernels, decode steps in CUDA graphs.
        run "$(bench_limit "$shape")" "$PY" -m engine.bench --device $DEVICE --shape "$shape" \
            --batch-sizes $BATCHES --new-tokens 32 --prompt-len 64 "${BENCH[@]}" ${BENCH_ARGS:-} --json "$r/bench-$shape.json"
        pack bench
    done
    # The fused small ops (models/layers/triton_fused.py) off and on: batch-1 to 64 decode of the
    # default model's shape and an 8B's, engine only.
    if [ "${FUSED_AB:-1}" = 1 ]; then
        for fused in 0 1; do
            ORCA_GPU_FUSED_OPS=$fused run 120 "$PY" -m engine.bench --device $DEVICE --shape smollm2-135m \
                --batch-sizes 1,16,64 --new-tokens 32 --prompt-len 64 --skip-hf --prefill-lens "" "${BENCH[@]}" \
                --json "$r/fused-$fused-smollm2-135m.json"
            [ "${GPU_CHECK_DRY:-0}" = 1 ] || ORCA_GPU_FUSED_OPS=$fused run 150 "$PY" -m engine.bench --device $DEVICE \
                --shape llama3-8b --batch-sizes 1,16,64 --new-tokens 32 --prompt-len 64 --skip-hf --prefill-lens "" \
                --json "$r/fused-$fused-llama3-8b.json"
        done
        pack bench
    fi
    [ "$PROFILES" = 1 ] || return 0
    # Where a batch-1 step's time goes, eagerly and with its graph.
    run 45 "$PY" -m engine.bench --device $DEVICE --shape smollm2-135m --profile 1 --enforce-eager "${BENCH[@]}" \
        >"$r/profile-smollm2-b1-eager.txt" 2>&1
    run 45 "$PY" -m engine.bench --device $DEVICE --shape smollm2-135m --profile 1 "${BENCH[@]}" \
        >"$r/profile-smollm2-b1-graphs.txt" 2>&1
    pack bench
}

bench_limit() {
    [ -z "${BENCH_LIMIT:-}" ] || { echo "$BENCH_LIMIT"; return; }
    case $1 in
        llama3-8b | qwen3-8b) echo 270 ;;
        *) echo 200 ;;
    esac
}

# write_default_shape DIR: the default model's shape with random weights and its tokenizer, in DIR.
write_default_shape() {
    "$PY" -c "import sys; from engine.model_shapes import write_shape; write_shape('smollm2-135m', sys.argv[1])" "$1"
    cp "$TOKENIZER"/* "$1"/
}

phase_http() {
    local r=$WORK/http model=$WORK/smollm2-135m
    mkdir -p "$r"
    [ -f "$model/config.json" ] || write_default_shape "$model"
    # Speculation off, as in loadtest.paper: random weights repeat themselves, which n-gram lookup
    # would accept every time.
    local server="$PY -m server --model $model --load-format dummy --device $DEVICE --speculative off"
    # Servers run side by side on one GPU (--interleave): each gets a fixed KV budget instead of 90% of
    # whatever is free when it starts.
    local kv="--kv-cache-memory $KV_MEMORY"
    local common=(--workload orca --interleave --tokenizer "$TOKENIZER" --seed 0 --no-progress --log-dir "$r"
        --num-requests $REQUESTS "${LOADTEST[@]}")
    # One sweep: seconds allowed, its name, its rates, then the --launch/--label pairs; afterwards the
    # servers it left are stopped and the results packed (what a later phase's failure cannot lose).
    sweep() {
        local seconds=$1 name=$2 rates=$3
        shift 3
        run "$seconds" "$PY" -m loadtest "${common[@]}" --request-rates "$rates" --output "$r/$name.json" "$@"
        stop_stray_servers
        pack http
    }
    # HTTP_SWEEPS picks which of the three sweeps run (a short lease: "scheduling").
    local sweeps=" ${HTTP_SWEEPS:-scheduling kv-policy chunked-prefill} "
    # Scheduling (the paper's claim): iteration against request, and iteration with graphs for decode
    # steps only (--cuda-graphs decode: what piecewise graphs do for the steps that admit prompts).
    [[ $sweeps != *" scheduling "* ]] || sweep "${SCHEDULING_LIMIT:-300}" scheduling "$RATES" \
        --launch "$server $kv --scheduling iteration" --label iteration \
        --launch "$server $kv --scheduling request" --label request \
        --launch "$server $kv --scheduling iteration --cuda-graphs decode" --label iteration-decode-graphs
    # KV policy under a scarce cache (256 blocks: 4096 tokens), and chunked prefill with a token budget
    # under the longest prompts.
    [[ $sweeps != *" kv-policy "* ]] || sweep 120 kv-policy "$MORE_RATES" \
        --launch "$server --num-kv-blocks 256 --kv-policy lazy" --label lazy \
        --launch "$server --num-kv-blocks 256 --kv-policy reserve" --label reserve
    [[ $sweeps != *" chunked-prefill "* ]] || sweep 120 chunked-prefill "$MORE_RATES" \
        --launch "$server $kv --max-num-batched-tokens 256" --label chunked \
        --launch "$server $kv --no-chunked-prefill" --label unchunked
}

# Where an iteration-level server's time goes under load (PROFILE_RATES, default 64,256; more server and
# load-test arguments in PROFILE_SERVER_ARGS and PROFILE_LOADTEST_ARGS): one server,
# py-spy sampling every thread of it (carried by scripts/gpu_prepare.sh), the /live feed's per-step
# durations and batch shapes, and the load test's own table.
phase_profile() {
    local r=$WORK/profile model=$WORK/smollm2-135m port=18177
    mkdir -p "$r"
    [ -f "$model/config.json" ] || write_default_shape "$model"
    "$PY" -m server --model "$model" --load-format dummy --device $DEVICE --speculative off \
        --kv-cache-memory $KV_MEMORY --scheduling iteration ${PROFILE_SERVER_ARGS:-} --host 127.0.0.1 --port $port \
        >"$r/server.log" 2>&1 &
    local server=$! i
    for i in $(seq 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 1
    done
    curl -sN "http://127.0.0.1:$port/live/events" >"$r/live.txt" 2>/dev/null &
    local feed=$! spy=""
    if command -v py-spy >/dev/null; then
        py-spy record --pid $server --rate 250 --threads --nonblocking --format raw -o "$r/py-spy.txt" \
            >"$r/py-spy.log" 2>&1 &
        spy=$!
        # The same threads with their idle samples too (blocked on a lock, the GIL included, or in a
        # sleeping system call): where a thread waits, against where it runs. PROFILE_NATIVE=1 adds the
        # C frames, which name what a waiting thread waits in (take_gil: the GIL; a CUDA call: the
        # GPU); py-spy must pause the process for those, so that recording samples less often.
        local idle_opts="--rate 250 --nonblocking"
        [ -z "${PROFILE_NATIVE:-}" ] || idle_opts="--rate 50 --native"
        py-spy record --pid $server $idle_opts --threads --idle --format raw \
            -o "$r/py-spy-idle.txt" >"$r/py-spy-idle.log" 2>&1 &
        spy="$spy $!"
    else
        log "no py-spy: run scripts/gpu_prepare.sh"
    fi
    run 200 "$PY" -m loadtest --base-url "http://127.0.0.1:$port" --workload orca --tokenizer "$TOKENIZER" \
        --seed 0 --no-progress --num-requests $REQUESTS --request-rates "${PROFILE_RATES:-64,256}" \
        --output "$r/loadtest.json" "${LOADTEST[@]}" ${PROFILE_LOADTEST_ARGS:-}
    [ -z "$spy" ] || { kill -INT $spy; wait $spy; }
    [ ! -f "$r/py-spy-idle.txt" ] || "$PY" -m loadtest.step_profile "$r/live.txt" --py-spy "$r/py-spy-idle.txt" \
        --top 40 >"$r/summary-idle.txt"
    kill $feed 2>/dev/null
    kill -INT $server
    wait $server
    "$PY" -m loadtest.step_profile "$r/live.txt" ${spy:+--py-spy "$r/py-spy.txt"} | tee "$r/summary.txt"
    pack profile
}

# Issue #28 item 2 on a GPU: TPOT at one stream (TPOT_CONCURRENCY) through the real IterationLoop
# against engine.bench's bare decode step of the same engine, --overlap-schedule off and on, per shape
# (TPOT_SHAPES; TPOT_LIMIT seconds each), random bf16 weights. Where the step thread waits in native
# code while the GPU computes, overlap should hide the loop's CPU work.
phase_tpot() {
    local r=$WORK/tpot shape dir tiny=""
    mkdir -p "$r"
    [ "${GPU_CHECK_DRY:-0}" = 1 ] && tiny=1
    for shape in ${TPOT_SHAPES:-smollm2-135m gemma-3-1b qwen3-8b}; do
        dir=$WORK/shapes/$shape
        "$PY" -c "import sys; from engine.model_shapes import write_shape; write_shape(sys.argv[1], sys.argv[2], bool(sys.argv[3]))" \
            "$shape" "$dir" "$tiny"
        run "${TPOT_LIMIT:-120}" "$PY" -m loadtest.tpot --model "$dir" --load-format dummy --device $DEVICE \
            --dtype "${TPOT_DTYPE:-bfloat16}" --concurrency "${TPOT_CONCURRENCY:-1}" \
            --new-tokens "${TPOT_NEW_TOKENS:-128}" --repeats "${TPOT_REPEATS:-3}" --json "$r/tpot-$shape.json"
        pack tpot
    done
}

# The load test starts each server in a session of its own and stops it; if the load test itself was
# killed at its time limit, its servers (found by the model path only this script uses) are stopped here.
stop_stray_servers() {
    local pids
    pids=$(pgrep -f -- "-m server --model $WORK/" || true)
    [ -z "$pids" ] && return 0
    log "stopping servers left behind: $pids"
    kill $pids 2>/dev/null
    sleep 5
    kill -9 $pids 2>/dev/null || true
}

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(env tests bench http)
for phase in "${phases[@]}"; do
    case $phase in
        env | tests | bench | http | profile | tpot) ;;
        *) echo "unknown phase $phase (env, tests, bench, http, profile, tpot)" >&2; exit 2 ;;
    esac
done
setup_python
for phase in "${phases[@]}"; do
    log "phase $phase" | tee -a "$OUT/$phase.log"
    "phase_$phase" 2>&1 | tee -a "$OUT/$phase.log"
done
log "done; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
