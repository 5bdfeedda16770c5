"""Fixtures the scheduler's loop tests share."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.loop import IterationLoop

GUARD_S = 20  # a hang fails the test instead of stalling the suite


@pytest.fixture
async def make_engine():
    """Make IterationLoops over (fake) runners, started; each is shut down after the test."""
    engines: list[IterationLoop] = []

    async def make(runner: FakeRunner | None = None, **cfg) -> IterationLoop:
        engine = IterationLoop(runner or FakeRunner(), SchedulerConfig(**cfg) if cfg else None)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        await asyncio.wait_for(e.shutdown(), GUARD_S)
