"""SIGTERM, for real: a server process (the fake runner behind the real CLI's uvicorn set-up) stops
admission at once, lets the stream in flight finish within the grace period, then exits 0; a stream
longer than the grace period is cut, and the exit is still 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes import SERVER_START_TIMEOUT_S
from waiting import wait_for

from engine.ports import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = """
import sys
from fakes import FakeRunner, fake_loader, server_config
from server.app import create_app
from server.cli import configure_logging, serve
from server.tokenizer import ServerTokenizer

tokenizer_dir, port, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
config = server_config(model="fake-model", port=port, shutdown_grace_s=grace, log_stats_interval_s=0)
configure_logging("info")
runner = FakeRunner(step_delay_s=0.005)
raise SystemExit(serve(create_app(config, fake_loader(ServerTokenizer.from_pretrained(tokenizer_dir), runner)), config))
"""


def start_server(tokenizer_dir: Path, grace: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_tcp_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(tokenizer_dir), str(port), str(grace)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode() if proc.stdout else "server exited")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, SERVER_START_TIMEOUT_S, poll_s=0.1)
    except AssertionError:
        proc.kill()
        raise
    return proc, url


@pytest.fixture
def server_factory(smollm2_tokenizer_dir) -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def make(grace: float) -> str:
        proc, url = start_server(smollm2_tokenizer_dir, grace)
        procs.append(proc)
        return url

    yield make, procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stream_lines(client: httpx.Client, max_tokens: int) -> Iterator[str]:
    body = {"prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                yield line[5:].strip()


def test_sigterm_drains_in_flight_then_exits_0(server_factory):
    make, procs = server_factory
    url = make(grace=30.0)
    [proc] = procs
    with httpx.Client(base_url=url, timeout=60) as client:
        lines = stream_lines(client, max_tokens=150)
        first = next(lines)
        proc.send_signal(signal.SIGTERM)
        # Admission stops: a new connection is refused (the socket is closed) or answered 503.
        with httpx.Client(base_url=url, timeout=10) as other:
            try:
                r = other.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                assert r.status_code == 503, r.text
            except httpx.TransportError:
                pass
        rest = list(lines)
    assert first != "[DONE]" and rest[-1] == "[DONE]"
    assert '"finish_reason":"length"' in rest[-2]  # the stream ran to its end, not cut
    assert proc.wait(timeout=60) == 0


def test_sigterm_cuts_streams_after_the_grace_period(server_factory):
    make, procs = server_factory
    url = make(grace=0.5)
    [proc] = procs
    with httpx.Client(base_url=url, timeout=60) as client:
        lines = stream_lines(client, max_tokens=480)  # ~2.5 s of steps: longer than the grace
        next(lines)
        proc.send_signal(signal.SIGTERM)
        try:
            rest = list(lines)
        except httpx.TransportError:  # cut mid-chunk
            rest = []
    assert not any('"finish_reason":"length"' in line for line in rest)
    assert proc.wait(timeout=60) == 0
    log = proc.stdout.read().decode() if proc.stdout else ""
    assert "draining" in log
