"""The live iteration feed: the loop's per-step reports, sent to viewers of /live as SSE messages.

The loop must never wait for a viewer, so the work is split in two:
- on the loop's step path, `on_step` appends the StepReport to a bounded deque and returns: no JSON,
  no I/O, no allocation beyond the deque slot (the report itself is built by the loop anyway);
- a sender task, alive only while someone watches, wakes every `interval_s`, takes the steps that
  arrived since its last turn, encodes them to JSON once for all viewers, and puts the message on each
  viewer's own bounded deque. A viewer that reads slowly loses its oldest messages (the page sees the
  gap in the step numbers); the sender never waits on a socket.

Throttling and sampling: at most one message per viewer per interval, holding at most
`max_steps_per_message` steps and `max_entries_per_message` batch entries. When more ran in one interval
(a fast model, a large batch), the newest steps are sent whole and the older ones are summarised as a
gap (how many, and which requests finished or were preempted in it), so the view stays one column per
iteration where it shows iterations at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scheduler.outputs import StepReport


@dataclass(frozen=True)
class FeedLimits:
    history: int = 4096  # reports the loop's listener keeps (a deque: the oldest fall off)
    interval_s: float = 0.1  # the sender's period: at most this many messages per second per viewer
    max_steps_per_message: int = 64  # past this in one interval, older steps become a gap summary
    # ... and past this many batch entries (requests x steps): a full batch of 256 requests sends 4 steps
    # per message, not 64 (~40 KiB a message, ~0.4 MB/s per viewer at most, with OpenAI-style ids).
    max_entries_per_message: int = 1024
    backlog_steps: int = 256  # recent steps a new viewer gets at once, so the view is not empty
    viewer_queue: int = 16  # messages a slow viewer may have pending before its oldest are dropped


def step_event(r: StepReport) -> dict[str, Any]:
    """One step as the page reads it. The batch is parallel arrays (the report's own lists), which
    json encodes in C without building an object per request; a step that verified proposals also
    has "spec" and "accepted" (per request: proposed tokens, and how many the model accepted)."""
    event = {
        "step": r.step,
        "duration_ms": round(r.duration_s * 1000, 3),
        "ids": r.request_ids,
        "tokens": r.request_num_tokens,
        "starts": r.request_start_positions,
        "decode": r.request_is_decode,
        "preempted": r.preempted_ids,
        "finished": r.finished_ids,
        "waiting": r.num_waiting,
        "kv_used": r.kv_blocks_used,
        "kv_total": r.kv_blocks_total,
        "failed": r.failed,
    }
    if r.num_spec_proposed:
        event["spec"] = r.request_num_proposed
        event["accepted"] = r.request_num_accepted
    return event


def encode_message(reports: list[StepReport], max_steps: int, max_entries: int) -> str:
    """Reports (oldest first) as one JSON message: the newest whole, up to `max_steps` steps and
    `max_entries` batch entries (at least one step), the older ones summarised as a gap."""
    keep, entries = 0, 0
    for r in reversed(reports):
        if keep == max_steps or (keep and entries + r.num_seqs > max_entries):
            break
        keep += 1
        entries += r.num_seqs
    skipped, sent = reports[: len(reports) - keep], reports[len(reports) - keep :]
    message: dict[str, Any] = {"time": time.time(), "steps": [step_event(r) for r in sent]}
    if skipped:
        message["gap"] = {
            "from": skipped[0].step,
            "to": skipped[-1].step,
            "finished": [i for r in skipped for i in r.finished_ids],
            "preempted": [i for r in skipped for i in r.preempted_ids],
        }
    return json.dumps(message, separators=(",", ":"))


@dataclass(eq=False)
class _Viewer:
    pending: deque[str]
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: int = 0  # messages lost because this viewer read too slowly

    def push(self, message: str) -> None:
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1  # the deque drops the oldest on append
        self.pending.append(message)
        self.ready.set()


class IterationFeed:
    def __init__(self, limits: FeedLimits | None = None) -> None:
        self.limits = limits or FeedLimits()
        self._reports: deque[StepReport] = deque(maxlen=self.limits.history)
        self._viewers: set[_Viewer] = set()
        self._sender: asyncio.Task[None] | None = None
        self._ended = False
        self.messages_sent = 0  # encoded messages (once per interval with news, whatever the viewers)

    def on_step(self, report: StepReport) -> None:
        """The loop's step listener: one deque append, nothing else (it runs between two steps)."""
        self._reports.append(report)

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    async def subscribe(self) -> AsyncIterator[str]:
        """JSON messages for one viewer until it closes the iterator: the recent backlog, then a message
        per interval in which steps ran."""
        viewer = _Viewer(deque(maxlen=self.limits.viewer_queue))
        backlog = list(self._reports)[-self.limits.backlog_steps :]
        if backlog:
            viewer.push(
                encode_message(backlog, self.limits.backlog_steps, 4 * self.limits.max_entries_per_message)
            )
        self._viewers.add(viewer)
        if self._sender is None or self._sender.done():
            last = self._reports[-1].step if self._reports else 0
            self._sender = asyncio.get_running_loop().create_task(self._send(last), name="orca-live-feed")
        try:
            while not self._ended:
                await viewer.ready.wait()
                viewer.ready.clear()
                while viewer.pending and not self._ended:
                    yield viewer.pending.popleft()
        finally:
            self._viewers.discard(viewer)
            if not self._viewers and self._sender is not None:
                self._sender.cancel()
                self._sender = None

    async def _send(self, last_step: int) -> None:
        while self._viewers:
            await asyncio.sleep(self.limits.interval_s)
            new = self._since(last_step)
            if not new:
                continue
            last_step = new[-1].step
            message = encode_message(
                new, self.limits.max_steps_per_message, self.limits.max_entries_per_message
            )
            self.messages_sent += 1
            for viewer in self._viewers:
                viewer.push(message)

    def _since(self, step: int) -> list[StepReport]:
        """Reports after `step`, oldest first; scans from the newest end, so the cost is the news only."""
        out: list[StepReport] = []
        for report in reversed(self._reports):
            if report.step <= step:
                break
            out.append(report)
        out.reverse()
        return out

    def end(self) -> None:
        """End every viewer's stream (the server is draining: an open view must not hold it up)."""
        self._ended = True
        for viewer in self._viewers:
            viewer.ready.set()

    async def close(self) -> None:
        self.end()
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None
