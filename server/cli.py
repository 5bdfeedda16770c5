"""`python -m server` / `orca-serve`: parse flags, start uvicorn at once, load the model behind it."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from engine.cli_args import add_flags
from engine.config import EngineConfig
from scheduler.config import SchedulerConfig
from server.config import ServerConfig, read_key_file

if TYPE_CHECKING:
    from server.state import ServerState

# The key can come from the environment (containers, secrets managers) instead of the command line,
# where every user of the machine can read it in the process list.
API_KEY_ENV = "ORCA_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    """Every flag, each declared on the config dataclass field it sets (engine.cli_args.flag), but for
    the API keys and CORS origins, which are shaped here."""
    p = argparse.ArgumentParser(
        prog="orca-serve", description="OpenAI-compatible LLM server with ORCA iteration-level scheduling."
    )
    EngineConfig.add_cli_args(p)
    SchedulerConfig.add_cli_args(p)
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
    add_flags(p, ServerConfig)
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
    names = ("max_n", "max_choices", "max_logprobs", "max_stop_strings", "max_connections")
    for name in (*names, "responses_store_max_entries"):
        if getattr(a, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    keys = _api_keys(parser, a)
    # The server's own fields come straight from the flags of the same name; a few are shaped here.
    own = {f.name: getattr(a, f.name) for f in fields(ServerConfig) if hasattr(a, f.name)}
    own.update(
        api_key=keys[0] if keys else None,
        api_keys=keys[1:],
        allowed_origins=tuple(a.allowed_origins) if a.allowed_origins is not None else None,
        max_queue_len=a.max_queue_len or None,
        max_connections=a.max_connections or None,
        body_timeout_s=a.body_timeout_s or None,
        stream_send_timeout_s=a.stream_send_timeout_s or None,
    )
    try:
        return ServerConfig(
            engine=EngineConfig.from_cli_args(a), scheduler=SchedulerConfig.from_cli_args(a), **own
        )
    except ValueError as exc:  # a value each flag accepts alone, but not together
        parser.error(str(exc))


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

    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_grace_s,
            # A request on a connection past the cap gets uvicorn's 503 before the app sees it.
            limit_concurrency=config.max_connections,
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
    if config.max_connections is not None:
        fit_open_files_limit(config.max_connections)
    with sigterm_after_drain_is_clean():
        server.run()
    return 1 if failed else 0


# File descriptors the server needs besides its connections (model files, worker sockets, logs).
SPARE_FILES = 256


def fit_open_files_limit(max_connections: int) -> None:
    """Every connection is a file descriptor: raise the soft RLIMIT_NOFILE toward the hard one, so a
    flood meets --max-connections (a 503) rather than EMFILE (accept() failing, logged each time)."""
    import resource

    need = max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    new = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        logging.getLogger(__name__).warning(
            "open files are limited to %d (ulimit -n): fewer than --max-connections %d + %d; raise the "
            "limit or lower --max-connections",
            new,
            max_connections,
            SPARE_FILES,
        )


@contextlib.contextmanager
def sigterm_after_drain_is_clean() -> Iterator[None]:
    """uvicorn re-raises a signal it caught once it has shut down, to the handler that was installed
    before it started (so the process ends as that signal says). A SIGTERM has been drained by then, so
    the handler installed here does nothing and the process exits 0; SIGINT keeps Python's default."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    previous = signal.signal(signal.SIGTERM, _ignore_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    return None


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_level)
    if config.engine.tensor_parallel_size * config.engine.pipeline_parallel_size > 1:
        from server.loader import is_torchrun_worker

        if is_torchrun_worker():  # torchrun started every rank with this command; rank 0 serves HTTP
            from engine.distributed_executor import run_torchrun_worker

            run_torchrun_worker(config.engine)  # this rank's shard, until the driver shuts the group down
            return 0
    from server.app import create_app

    return serve(create_app(config), config)
