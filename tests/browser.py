"""Headless Chromium for the web UI tests: the system's browser and driver (Debian's `chromium` and
`chromium-driver`) driven by selenium, against a real app served by uvicorn on a thread of its own.

The browser never downloads anything: selenium is given both binaries (Selenium Manager is not asked),
and Chromium's own background traffic is switched off (this machine's network refuses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from waiting import wait_for

from engine.ports import LOOPBACK, free_tcp_port

T = TypeVar("T")

HOW_TO_GET = (
    "the browser tests need headless Chromium and its driver: `apt-get install -y chromium chromium-driver` "
    "(as root; `make test` does it where it can) and selenium (`pip install -e '.[dev]'`)"
)

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    # Background tabs keep their timers: the live-view test has chats streaming in tabs it is not on.
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
)


def chromium_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return HOW_TO_GET
    return None if chromium_paths() else HOW_TO_GET


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 860) -> Iterator[Any]:
    """A selenium WebDriver over a fresh headless Chromium profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    assert paths is not None, HOW_TO_GET
    browser, driver_path = paths
    with tempfile.TemporaryDirectory(prefix="orca-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        options.add_argument(f"--window-size={width},{height}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # for page_errors()
        driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def page_errors(driver) -> list[str]:
    """Errors the pages logged since the last call (uncaught exceptions, failed loads), except the
    401s that a server with --api-key answers before the page has a key."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "status of 401" not in entry["message"]
    ]


class ServedApp:
    """The app under uvicorn on a free local port, on a thread with its own event loop (the tests
    themselves are synchronous selenium code). `run(coro)` runs a coroutine on the server's loop."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.port = free_tcp_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._loop = asyncio.new_event_loop()
        config = uvicorn.Config(
            app, host=LOOPBACK, port=self.port, log_level="warning", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="orca-test-server", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve())
        # What the server left behind (sse-starlette's shutdown watchers) ends here, not at loop close.
        leftover = asyncio.all_tasks(self._loop)
        for task in leftover:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))

    def __enter__(self) -> ServedApp:
        self._thread.start()

        def started() -> bool:
            if not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            return self._server.started

        wait_for(started, poll_s=0.01)
        self.run(self.app.state.server.wait_ready())
        return self

    def __exit__(self, *exc: object) -> None:
        # As on SIGTERM (server.cli): draining ends the open live-view streams, then uvicorn stops.
        self.call(self.app.state.server.start_draining)
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the server's loop (the engine's state is only read there)."""

        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())
