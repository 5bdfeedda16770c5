"""`python -m server` / `orca-serve`: parse flags, start uvicorn at once, load the model behind it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from server.config import ServerConfig, parse_size, read_key_file

if TYPE_CHECKING:
    from server.state import ServerState

# The key can come from the environment (containers, secrets managers) instead of the command line,
# where every user of the machine can read it in the process list.
API_KEY_ENV = "ORCA_API_KEY"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="orca-serve", description="OpenAI-compatible LLM server with ORCA iteration-level scheduling."
    )
    p.add_argument(
        "--model",
        default=d.model,
        help="HF model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="name clients send as `model` (default: the --model value)"
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests per iteration (ORCA's max_bs)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per iteration",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="cap on prompt + output tokens (default: the model's)"
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-memory", type=_size, default=None, help="KV cache bytes, suffixes allowed: 512MiB, 2GiB"
    )
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--scheduling", default=d.scheduling, choices=["iteration", "request"])
    p.add_argument("--kv-policy", default=d.kv_policy, choices=["lazy", "reserve"])
    p.add_argument("--no-chunked-prefill", action="store_true", help="run each prompt in one iteration")
    p.add_argument(
        "--attention-backend", default=d.attention_backend, help="auto, sdpa, torch-varlen, flash-attn, ..."
    )
    p.add_argument(
        "--weight-packing",
        default=d.weight_packing,
        choices=["auto", "off"],
        help="auto: run exactly group-quantized weights (a GGUF model's) on the int8 CPU kernel, "
        "bit-identical weights at 1.25 instead of 4 bytes each; off: keep float32",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks that split every layer; workers start on this machine, or under torchrun "
        "(docs/parallelism.md)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=d.pipeline_parallel_size,
        help="stages the layers are split into; that many batches are kept in flight",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"require `Authorization: Bearer <key>` on all routes but /health, /metrics; repeat for "
        f"several keys (also read from ${API_KEY_ENV})",
    )
    p.add_argument("--api-key-file", type=Path, default=None, help="file with one API key per line")
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        help="enable CORS for these origins ('*' for any); off by default",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=d.max_queue_len,
        help="requests allowed to wait for admission; more get 429 + Retry-After (0: unbounded)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run before it is aborted with 408 (default: no limit)",
    )
    p.add_argument("--max-body-size", type=_size, default=d.max_body_bytes, help="request body limit (413)")
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n a request may ask for")
    p.add_argument(
        "--max-choices", type=int, default=d.max_choices, help="largest prompts x n of one request"
    )
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="largest (top_)logprobs")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens of a request")
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace_s,
        help="on SIGTERM, seconds in-flight requests get to finish before they are cut",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=d.log_stats_interval_s,
        help="seconds between throughput / queue / KV log lines (0: off)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed for requests that send none")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def _api_keys(parser: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[str, ...]:
    keys = list(a.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    if a.api_key_file is not None:
        try:
            keys.extend(read_key_file(a.api_key_file))
        except (OSError, ValueError) as exc:
            parser.error(f"--api-key-file: {exc}")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    for name in ("max_n", "max_choices", "max_logprobs", "max_stop_strings"):
        if getattr(a, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    keys = _api_keys(parser, a)
    return ServerConfig(
        model=a.model,
        served_model_name=a.served_model_name,
        host=a.host,
        port=a.port,
        dtype=a.dtype,
        device=a.device,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        kv_cache_memory=a.kv_cache_memory,
        num_kv_blocks=a.num_kv_blocks,
        block_size=a.block_size,
        scheduling=a.scheduling,
        kv_policy=a.kv_policy,
        chunked_prefill=not a.no_chunked_prefill,
        attention_backend=a.attention_backend,
        weight_packing=a.weight_packing,
        tensor_parallel_size=a.tensor_parallel_size,
        pipeline_parallel_size=a.pipeline_parallel_size,
        api_key=keys[0] if keys else None,
        api_keys=keys[1:],
        allowed_origins=tuple(a.allowed_origins) if a.allowed_origins is not None else None,
        max_queue_len=a.max_queue_len or None,
        request_timeout_s=a.request_timeout,
        max_body_bytes=a.max_body_size,
        max_n=a.max_n,
        max_choices=a.max_choices,
        max_logprobs=a.max_logprobs,
        max_stop_strings=a.max_stop_strings,
        max_tokens=a.max_tokens_limit,
        shutdown_grace_s=a.shutdown_grace,
        log_stats_interval_s=a.log_stats_interval,
        seed=a.seed,
        log_level=a.log_level,
    )


def configure_logging(level: str) -> None:
    """One stderr handler whose lines carry the id of the request they are about ("-" otherwise)."""
    from server.middleware import RequestIdFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def make_server(app: Any, config: ServerConfig) -> Any:
    """uvicorn.Server that drains on SIGTERM: the app stops taking requests (503, /health 503), those
    in flight get `shutdown_grace_s` to finish, then the engine shuts down and the process exits 0."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    # sse-starlette ends every open stream as soon as SIGTERM arrives; streams should finish instead
    # (uvicorn cancels what is left when the grace period ends).
    AppStatus.disable_automatic_graceful_drain()
    state: ServerState = app.state.server

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state.start_draining()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # uvicorn re-raises a caught signal once it has shut down, which would end the process
                # with -SIGTERM; a drain that completed is a clean exit.
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list) and sig in captured:
                    captured.remove(sig)

    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_grace_s,
            # server.middleware writes the access log itself, with the request id.
            access_log=False,
        )
    )


def serve(app: Any, config: ServerConfig) -> int:
    """Run the app until SIGTERM / SIGINT (0) or a failed model load (1)."""
    server = make_server(app, config)
    failed: list[str] = []

    def stop(reason: str) -> None:
        # A server without a model can only answer 503s: exit so a supervisor sees the failure.
        failed.append(reason)
        server.should_exit = True

    app.state.server.on_load_failed = stop
    server.run()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_level)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from server.loader import is_torchrun_worker, run_torchrun_worker

        if is_torchrun_worker():  # torchrun started every rank with this command; rank 0 serves HTTP
            return run_torchrun_worker(config)
    from server.app import create_app

    return serve(create_app(config), config)
