"""Connection floods and slow clients, over real sockets (uvicorn in this event loop, the fake runner):
a cap on open connections answered with a fast 503, a body sent too slowly answered 408, and a stream
whose client never reads is aborted (its request leaves the batch and frees its KV blocks) instead of
running to max_tokens."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from fakes import FakeRunner, drained, live_server, loop_of, make_app
from waiting import wait_until

from engine.ports import LOOPBACK


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    sock.connect_ex((host, int(port)))
    return sock


async def _send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


def _request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def _read_response(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 30)
        if not chunk:
            break
        data += chunk
    return data


async def test_connections_past_the_cap_get_a_fast_503(tokenizer):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_connections=3)
    async with live_server(app, as_cli=True) as url:
        await drained(app)
        # Three idle connections (a flood that sends nothing) fill the cap.
        idle = [_connect(url) for _ in range(3)]
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:

                async def refused_fast() -> bool:
                    # Each probe is a fourth connection: once the server has accepted the three idle
                    # ones, it is answered 503 at once (before the app runs), not queued.
                    t0 = time.perf_counter()
                    r = await http.get("/health")
                    return r.status_code == 503 and time.perf_counter() - t0 < 5

                await wait_until(refused_fast, poll_s=0.05)
        finally:
            for s in idle:
                s.close()
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:

            async def served() -> bool:  # the server sees the closed connections go
                return (await http.get("/health")).status_code == 200

            await wait_until(served, poll_s=0.05)


BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


async def _trickle(
    tokenizer, body_timeout_s: float, pieces: list[bytes], pause_s: float
) -> tuple[bytes, FakeRunner]:
    """A completions request whose body arrives in `pieces`, pause_s apart (stopping once the server
    answers): the head of the answer, and the runner behind the server."""
    runner = FakeRunner()
    app = make_app(tokenizer, runner, body_timeout_s=body_timeout_s)
    async with live_server(app) as url:
        sock = _connect(url)
        try:
            await _send(sock, _request_head("/v1/completions", len(BODY)))
            reader = asyncio.ensure_future(_read_response(sock))
            for piece in pieces:
                if reader.done():
                    break
                await _send(sock, piece)
                await asyncio.sleep(pause_s)  # pacing the client, not waiting for the server
            return await reader, runner
        finally:
            sock.close()


async def test_a_body_sent_a_byte_at_a_time_gets_408(tokenizer):
    # Byte by byte, and never the last one: the body cannot be whole within the limit.
    head, runner = await _trickle(tokenizer, 0.5, [bytes([b]) for b in BODY[:-1]], pause_s=0.05)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"body_timeout" in head
    assert runner.num_steps == 0  # nothing reached the engine


async def test_a_body_within_the_time_limit_is_served(tokenizer):
    head, _ = await _trickle(tokenizer, 5.0, [BODY[:5], BODY[5:]], pause_s=0.1)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]


async def test_a_stream_that_is_never_read_is_aborted(tokenizer):
    """The client sends its request and reads nothing: once the kernel's socket buffers and the
    transport's 64 KiB are full, sends block, and after stream_send_timeout_s the stream ends; its
    requests are aborted long before max_tokens, and their KV blocks are free."""
    runner = FakeRunner(num_kv_blocks=4096, max_model_len=8192)
    app = make_app(tokenizer, runner, stream_send_timeout_s=0.5, max_num_seqs=16)
    # 8 choices x top-5 logprobs: ~5 KB of events per step, so the buffers fill in a few hundred steps.
    max_tokens = 8000
    body = json.dumps(
        {
            "prompt": "hello",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "n": 8,
            "logprobs": 5,
        }
    ).encode()
    async with live_server(app) as url:
        engine = loop_of(app)
        sock = _connect(url, rcvbuf=4096)
        try:
            await _send(sock, _request_head("/v1/completions", len(body)) + body)
            await wait_until(lambda: engine.stats().running == 8)
            await wait_until(lambda: engine.stats().running == 0, timeout_s=60, poll_s=0.05)
            stats = engine.stats()
            # Aborted while the client is still connected, not finished: far fewer steps than tokens.
            assert stats.running == 0 and stats.kv_blocks_used == 0, stats
            assert runner.num_steps < max_tokens // 2
        finally:
            sock.close()
        await drained(app)
