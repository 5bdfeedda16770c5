"""A fake engine.contract.ModelRunner for fast server tests: deterministic tokens, no torch.

Greedy output is a function of the request's own context only (never of what shares the batch), like
a real model's. A `script` replaces that with fixed text, so stop-string and multi-byte tests know
exactly which tokens come out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from engine.contract import SampledToken, ScheduledSequence
from loadtest.launcher import LOOPBACK, free_port
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer

FIRST_PLAIN_TOKEN = 17  # SmolLM2's ids 0..16 are special tokens
PLAIN_TOKEN_SPAN = 20000  # common-word ids, so the text reads like words


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int = 256,
        block_size: int = 16,
        max_model_len: int = 512,
        eos_token_ids: frozenset[int] = frozenset({2}),
        script: Sequence[int] | None = None,
        step_delay_s: float = 0.0,
        fail_at_step: int | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = 49152
        self.script = list(script) if script is not None else None
        self.step_delay_s = step_delay_s
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.max_batch_seen = 0
        self._rng = random.Random(0)
        # Lets a test hold the loop inside a step (disconnect tests) without sleeping on a clock.
        self.gate = threading.Event()
        self.gate.set()

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("injected step failure")
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        return [self._sample(seq) if seq.sample else None for seq in batch]

    def _sample(self, seq: ScheduledSequence) -> SampledToken:
        params = seq.sampling
        out_len = len(seq.output_token_ids)
        if self.script is not None:
            token = self.script[out_len % len(self.script)]
        else:
            context = [*seq.prompt_token_ids, *seq.output_token_ids]
            if params.greedy:
                key = repr(context)
            elif params.seed is not None:
                key = f"{params.seed}:{context!r}"
            else:
                key = str(self._rng.random())
            digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
            token = FIRST_PLAIN_TOKEN + int.from_bytes(digest, "little") % PLAIN_TOKEN_SPAN
        logprob = None
        top = None
        if params.logprobs is not None:
            # A made-up but well-formed distribution: the chosen token is the likeliest.
            logprob = -0.25
            top = [(token, logprob)] + [(token + i, -0.25 - i) for i in range(1, params.logprobs)]
            top = top[: params.logprobs]
            assert all(lp <= 0 and not math.isnan(lp) for _, lp in top)
        return SampledToken(token, logprob, top)


# --- harness: the app over ASGI, over real sockets, and SSE parsing -----------------------------


def fake_loader(tokenizer: ServerTokenizer, runner: FakeRunner) -> Callable[[], LoadedModel]:
    def load() -> LoadedModel:
        return LoadedModel(runner, tokenizer, runner.vocab_size)

    return load


@contextlib.asynccontextmanager
async def running_app(app: FastAPI, wait: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan run (httpx.ASGITransport does not run it) and an ASGI client."""
    async with app.router.lifespan_context(app):
        if wait:
            await app.state.server.wait_ready()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            yield client


@contextlib.asynccontextmanager
async def live_server(app: FastAPI) -> AsyncIterator[str]:
    """uvicorn serving the app on a free local port inside this event loop; yields the base URL.
    uvicorn runs the app's lifespan itself (model loading at startup, engine shutdown at exit)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the start-up error
        await asyncio.sleep(0.01)
    await app.state.server.wait_ready()
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        await task


def parse_sse(body: str) -> list[Any]:
    """`data:` payloads of an SSE body in order: dicts for JSON events, the string "[DONE]" for the end.
    Comment lines (pings) are skipped, as the spec says."""
    events: list[Any] = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue
        payload = "\n".join(data)
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def wait_until(predicate: Callable[[], bool], steps: int = 2000) -> None:
    """Yield to the loop until predicate() holds; bounded by a number of turns, not by a clock."""
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never became true")


# --- the app with the fake runner, and what tests read off it ------------------------------------

MODEL = "fake-model"  # the served name of every fake-runner app


def make_app(tokenizer: ServerTokenizer, runner: FakeRunner | None = None, **config: Any) -> FastAPI:
    """The real app (real IterationLoop) over a fake runner; the periodic stats log is off unless asked."""
    from server.app import create_app
    from server.config import ServerConfig

    config.setdefault("log_stats_interval_s", 0)
    return create_app(ServerConfig(model=MODEL, **config), fake_loader(tokenizer, runner or FakeRunner()))


@contextlib.asynccontextmanager
async def serving(app: FastAPI, runner: FakeRunner) -> AsyncIterator[httpx.AsyncClient]:
    """running_app that opens the runner's gate before shutting down, so a failing test that left
    a step held cannot hang the engine's shutdown."""
    try:
        async with running_app(app) as client:
            try:
                yield client
            finally:
                runner.gate.set()
    finally:
        runner.gate.set()


def loop_of(app: FastAPI) -> Any:
    return app.state.server.loop


async def drained(app: FastAPI) -> None:
    """Until the loop holds no request and no KV block."""
    engine = loop_of(app)

    def idle() -> bool:
        s = engine.stats()
        return s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0

    await wait_until(idle)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    """The body of an error answer, checked to be OpenAI's shape with the expected status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus exposition `text` (summed over labels not given)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def joined(events: list, index: int = 0, key: str = "text") -> str:
    """The text of choice `index` over a stream's events (key "content": chat deltas)."""
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        for ch in e["choices"]:
            if ch["index"] == index:
                out.append(ch["delta"].get("content", "") if key == "content" else ch["text"])
    return "".join(out)


def finish_reasons(events: list) -> dict[int, str]:
    return {
        ch["index"]: ch["finish_reason"]
        for e in events
        if e != "[DONE]"
        for ch in e["choices"]
        if ch["finish_reason"]
    }


def scripted_client(tokenizer: ServerTokenizer, text: str, **runner_kwargs: Any):
    """running_app over a fake runner whose output is exactly `text` (for stop strings, UTF-8)."""
    runner = FakeRunner(script=tokenizer.encode(text, add_special_tokens=False), **runner_kwargs)
    return running_app(make_app(tokenizer, runner))
