"""`python -m server.healthcheck [URL]`: exit 0 when the server's /health answers 200, else 1.

The container images' HEALTHCHECK runs it (both images, one command): /health is public even with an
API key, and 503 while loading, draining or after the scheduler loop died. Standard library only, so
it starts fast."""

from __future__ import annotations

import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def healthy(url: str = DEFAULT_URL, timeout_s: float = 4.0) -> bool:
    """Whether `url` answers 200 within `timeout_s` (an error status, a refused or timed-out
    connection: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:  # urllib.error.URLError and HTTPError (a 503) are OSErrors, as are timeouts
        return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return 0 if healthy(args[0] if args else DEFAULT_URL) else 1


if __name__ == "__main__":
    raise SystemExit(main())
