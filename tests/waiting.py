"""Waiting in tests: for a condition, up to a deadline in seconds.

Never for a count of event-loop turns or a fixed sleep: CI runs on loaded machines, where a step on
the worker thread can take longer than any number of turns, and a sleep long enough there makes every
run slow. A wait that times out fails with what it was waiting for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 30.0  # generous: a loaded 2-core CI machine, a server loading a model


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = TIMEOUT_S, poll_s: float = 0.005
) -> None:
    """Await until predicate() (sync, or a coroutine function) holds, polling every poll_s seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {_describe(predicate)}")
        await asyncio.sleep(poll_s)


def wait_for(predicate: Callable[[], T], timeout_s: float = TIMEOUT_S, poll_s: float = 0.05) -> T:
    """Block until predicate() is truthy (a server or a browser in another thread or process); returns
    the value it gave."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {_describe(predicate)}")
        time.sleep(poll_s)


def _describe(predicate: Callable[..., object]) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)
