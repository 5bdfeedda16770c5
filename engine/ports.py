"""A free TCP port on this machine: for the distributed executor's rendezvous, launched servers and
tests. Torch-free, so the load tester and the server's benchmarks import it without the engine."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_tcp_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now (the OS picks it; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
