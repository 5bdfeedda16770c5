"""Background responses (`background: true`): each runs in a task of its own, not tied to the client's
connection; the client polls GET /v1/responses/{id} and may cancel it. The tasks are cancelled at
shutdown too.

Cancelling runs the response's `on_cancel` (abort its choices, store it as "cancelled") here, after the
task has ended, not in the task: a task cancelled before it first ran never executes its coroutine,
while its choices were submitted when the request was answered and must still be aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class BackgroundResponses:
    def __init__(self) -> None:
        self._tasks: dict[str, tuple[asyncio.Task[None], Callable[[], Awaitable[None]]]] = {}

    def start(
        self, response_id: str, work: Coroutine[Any, Any, None], on_cancel: Callable[[], Awaitable[None]]
    ) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[response_id] = (task, on_cancel)
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> bool:
        """Cancel a running one and record that; False if none runs (or it ended meanwhile)."""
        entry = self._tasks.get(response_id)
        if entry is None:
            return False
        task, on_cancel = entry
        if not task.cancel():
            return False
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await on_cancel()
        return True

    async def shutdown(self) -> None:
        for response_id in list(self._tasks):
            await self.cancel(response_id)
