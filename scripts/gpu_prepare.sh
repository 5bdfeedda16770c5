#!/usr/bin/env bash
# Prepares, on a machine with the network, what scripts/gpu_check.sh needs on the GPU machine, which has
# none (its image has torch, triton, transformers, numpy, httpx, pytest, ... but not the server's web
# stack):
#   .whl/          wheels (CPython 3.12, manylinux x86_64) of the packages that image lacks, at the
#                  versions this checkout's .venv runs
#   .gpu-assets/   the default model's tokenizer (for the tests' tiny models, the server and the load
#                  test; the model itself is run as its shape with random weights, see engine/model_shapes.py)
# Both are git-ignored: name them in the device call's `carry` (docs/benchmarks.md, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# Missing from the GPU image (its package list: /work/.library/device/KINDS.md), needed by the server,
# the load test and the test suite (gguf: the model loader imports it; opentelemetry-api: fastapi does).
# typing-extensions, pytest and its plugins ride along at this checkout's versions: pydantic and
# pytest-asyncio need recent ones.
PACKAGES=(fastapi starlette uvicorn sse-starlette pydantic pydantic-core annotated-types typing-inspection
          typing-extensions pytest-asyncio llguidance pytest pluggy iniconfig pytest-timeout gguf opentelemetry-api)

rm -rf .whl && mkdir -p .whl
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$name==$version"
done

# py-spy samples the server's threads in gpu_check.sh's profile phase (a tool, not in .venv: the newest).
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 -d .whl py-spy

tokenizer=.gpu-assets/test-cache/smollm2-tokenizer  # the tests' cache layout (tests/conftest.py)
if [ ! -f "$tokenizer/tokenizer.json" ]; then
    "$PY" - "$tokenizer" <<'PY'
import sys
sys.path.insert(0, "tests")
from builders import default_gguf_path
from transformers import AutoTokenizer

gguf = default_gguf_path()
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(sys.argv[1])
PY
fi

ls -1 .whl
du -sh .whl .gpu-assets
echo "tracked files: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (the device takes 64 MiB in all)"
