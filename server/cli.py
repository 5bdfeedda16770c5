"""`python -m server` / `orca-serve`: parse flags, start uvicorn at once, load the model behind it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from server.config import ServerConfig, parse_size


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
        "--api-key",
        default=None,
        help="require `Authorization: Bearer <key>` (all routes but /health, /metrics)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed for requests that send none")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    a = build_parser().parse_args(argv)
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
        api_key=a.api_key,
        seed=a.seed,
        log_level=a.log_level,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    from server.app import create_app

    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level)
    )
    failed: list[str] = []

    def stop(reason: str) -> None:
        # A server without a model can only answer 503s: exit so a supervisor sees the failure.
        failed.append(reason)
        server.should_exit = True

    app.state.server.on_load_failed = stop
    server.run()
    return 1 if failed else 0
