"""Start a server command on a free loopback port, wait until it is healthy, and stop it afterwards."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import httpx

from engine.ports import LOOPBACK, free_tcp_port

_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=VALUE words (as a shell reads them) -> environment for the command, and the rest."""
    env: dict[str, str] = {}
    while argv and _ENV_WORD.match(argv[0]):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    return env, argv


def build_command(command: str, port: int) -> tuple[dict[str, str], list[str]]:
    """The environment additions and argv of a --launch command bound to `port` on loopback.

    Leading NAME=VALUE words set environment variables (`OMP_NUM_THREADS=1 python -m server`).
    `{port}` in the command is replaced; otherwise `--host 127.0.0.1 --port N` is appended. A leading
    `python`/`python3` becomes this interpreter, so `python -m server` runs in the same environment
    (a virtualenv's python is often not on PATH).
    """
    env, argv = split_env(shlex.split(command))
    if not argv:
        raise ValueError(f"--launch {command!r} has no command")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    if any("{port}" in a for a in argv):
        return env, [a.replace("{port}", str(port)) for a in argv]
    return env, [*argv, "--host", LOOPBACK, "--port", str(port)]


class ServerStartError(RuntimeError):
    pass


class LaunchedServer:
    """A server process in its own session (so it and any children stop together)."""

    def __init__(
        self,
        command: str,
        log_path: Path,
        health_timeout: float = 600.0,
        stop_timeout: float = 20.0,
    ) -> None:
        self.command = command
        self.port = free_tcp_port()
        self.env, self.argv = build_command(command, self.port)
        self.base_url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = log_path
        self.health_timeout = health_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()  # the child holds its own descriptor
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout
        with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"server exited with {self.proc.returncode} before it was healthy: {self.argv}\n"
                        f"--- {self.log_path} ---\n{self._log_tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.25)
        raise ServerStartError(
            f"server not healthy after {self.health_timeout:.0f}s: {self.argv}\n"
            f"--- {self.log_path} ---\n{self._log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM to the server's process group; SIGKILL if it has not exited in `stop_timeout`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        # Also whatever the server forked (workers) and left behind in its session.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def add_server_to_load_args(
    p: argparse.ArgumentParser, name: str, launch: str, duration_s: float, duration_help: str
) -> None:
    """The flags of a long run against one server (server_to_load): how long, which server (a running
    one, or a command to launch), its process id and log, and what to send it."""
    p.add_argument("--duration", type=float, default=duration_s, help=duration_help)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="a running server (default: launch one)")
    where.add_argument("--launch", default=launch, help="server command to start on a free port")
    p.add_argument(
        "--pid", type=int, default=None, help="the --url server's process id (its RSS, its workers)"
    )
    p.add_argument(
        "--log", type=Path, default=Path(f"results/{name}-server.log"), help="launched server's log"
    )
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None)


@contextlib.contextmanager
def server_to_load(
    url: str | None, launch: str, log: Path, pid: int | None, name: str
) -> Iterator[tuple[str, int | None]]:
    """(base URL, process id) of the server a long run loads: the one at `url` (with `pid`, when
    given, for its RSS or its workers), or `launch` started on a free port and stopped afterwards."""
    if url is not None:
        yield url, pid
        return
    server = LaunchedServer(launch, log)
    print(f"[{name}] starting: {' '.join(server.argv)} (log: {log})", file=sys.stderr, flush=True)
    server.start()
    try:
        yield server.base_url, server.proc.pid if server.proc is not None else None
    finally:
        server.stop()
