"""The test harness: the scheduler's fake executor sized for server tests, the real app over it (in
process over ASGI, or on a real socket), SSE parsing, and what tests read off responses and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from waiting import wait_for, wait_until

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.ports import LOOPBACK, free_tcp_port
from scheduler import fake_runner, overlap
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from server.config import ServerConfig
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer


class FakeRunner(fake_runner.FakeRunner):
    """The scheduler's fake executor with a server-sized cache: 256 blocks of 16 tokens, 512-token context."""

    def __init__(
        self, num_kv_blocks: int = 256, block_size: int = 16, max_model_len: int = 512, **kwargs: Any
    ) -> None:
        super().__init__(num_kv_blocks, block_size, max_model_len, **kwargs)


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
async def live_server(app: FastAPI, as_cli: bool = False) -> AsyncIterator[str]:
    """uvicorn serving the app on a free local port inside this event loop; yields the base URL.
    uvicorn runs the app's lifespan itself (model loading at startup, engine shutdown at exit).
    as_cli: the server `python -m server` runs (server.cli.make_server: its connection cap included)."""
    port = free_tcp_port()
    if as_cli:
        from server.cli import make_server

        config = dataclasses.replace(app.state.server.config, host=LOOPBACK, port=port, log_level="warning")
        server = make_server(app, config)
    else:
        server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())

    def started() -> bool:
        if task.done():
            task.result()  # raises the start-up error
        return server.started

    await wait_until(started, poll_s=0.01)
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


class RecordingRunner(FakeRunner):
    """Keeps each request's prompt as the engine received it, by request id."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prompts: dict[str, list[int]] = {}

    def submit(self, batch: Sequence[Any]) -> Any:
        for seq in batch:
            self.prompts.setdefault(seq.request_id, list(seq.prompt_token_ids))
        return super().submit(batch)


# A Qwen3-like chat template: the model opens its thinking itself, `enable_thinking=false` closes it in
# the prompt, and `reasoning_effort="high"` (a stand-in for templates that read it) opens it there.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif reasoning_effort is defined and reasoning_effort == 'high' %}<think>\n{%- endif %}"
    "{%- endif %}"
)


# A chat-completions function tool the tool tests share.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def scripted(tokenizer: ServerTokenizer, text: str, **runner_kwargs: Any) -> FakeRunner:
    """A fake runner whose every reply is exactly `text`, then EOS (token 2)."""
    return FakeRunner(script=[*tokenizer.encode(text, add_special_tokens=False), 2], **runner_kwargs)


# --- the app with the fake runner, and what tests read off it ------------------------------------

MODEL = "fake-model"  # the served name of every fake-runner app


def server_config(**flat: Any) -> ServerConfig:
    """A ServerConfig from flat keyword arguments, as flags give them: engine and scheduler fields go to
    the nested configs, the rest to the server's own."""
    flat.setdefault("responses_store", ":memory:")  # stored /v1/responses stay out of the user's cache
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    sched = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return ServerConfig(
        engine=EngineConfig(**{k: v for k, v in flat.items() if k in engine}),
        scheduler=SchedulerConfig(**{k: v for k, v in flat.items() if k in sched}),
        **{k: v for k, v in flat.items() if k not in engine and k not in sched},
    )


def make_app(tokenizer: ServerTokenizer, runner: FakeRunner | None = None, **config: Any) -> FastAPI:
    """The real app (real IterationLoop) over a fake runner; the periodic stats log is off unless asked."""
    from server.app import create_app

    config.setdefault("log_stats_interval_s", 0)
    return create_app(server_config(model=MODEL, **config), fake_loader(tokenizer, runner or FakeRunner()))


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


def run_to_end(sched: Any, executor: Any, requests: Sequence[Any], max_steps: int = 3000) -> None:
    """Every request through the synchronous Scheduler and a real or fake executor to its end."""
    for r in requests:
        sched.add(r)
    for _ in range(max_steps):
        if not sched.has_work():
            return
        step = sched.schedule()
        if step.seqs:
            sched.update(step, executor.step(step.seqs))
    assert not sched.has_work(), f"requests still running after {max_steps} steps"


def run_overlapped(
    sched: Any,
    executor: Any,
    requests: Sequence[Any],
    max_steps: int = 3000,
    each_step: Callable[[int], bool] | None = None,
) -> int:
    """As run_to_end, but overlapped as IterationLoop does it (scheduler/overlap.py), at its worst: each
    step is scheduled and run before the step before it is applied, so every finish is seen one step
    late. `each_step(n)`, called before the n-th schedule, may add and abort requests and says whether
    more will come. Returns the carried rows run (decodes scheduled before their token was known)."""
    for r in requests:
        sched.add(r)
    pending: tuple[Any, Any, list[Any], Any] | None = None  # step, rows run, their tokens, rows kept
    carried = 0
    for n in range(max_steps):
        more = each_step(n) if each_step is not None else False
        if not more and not sched.has_work() and pending is None:
            return carried
        step = (
            sched.schedule(pending=pending[0] if pending is not None else None) if sched.has_work() else None
        )
        new = None
        if step is not None and step.seqs:
            carried += sum(overlap.is_carried(s) for s in step.seqs)
            tokens = overlap.last_tokens(pending[1], pending[2]) if pending is not None else {}
            seqs, kept = overlap.resolve(step.seqs, step.requests, tokens)
            new = (step, seqs, executor.step(seqs) if seqs else [], kept)
        if pending is not None:
            done, _, results, kept = pending
            sched.update(overlap.kept_rows(done, kept) if kept is not None else done, results)
        pending = new
    raise AssertionError(f"requests still running after {max_steps} steps")


async def leave_mid_stream(client: httpx.AsyncClient, path: str, body: dict, marker: str) -> None:
    """POST a streamed request and hang up at the first line holding `marker` (a client gone mid-reply)."""
    async with client.stream("POST", path, json=body) as r:
        async for line in r.aiter_lines():
            if marker in line:
                return
    raise AssertionError(f"the stream ended without a line holding {marker!r}")


async def assert_hanging_up_frees_the_request(
    tokenizer: ServerTokenizer, path: str, body: dict, marker: str
) -> None:
    """A client that hangs up mid-reply (leave_mid_stream: at the first line holding `marker`) frees its
    request: the engine runs the step in flight and at most one more, and /metrics counts the request
    once, as a 200."""
    runner = scripted(tokenizer, "Hello there, friend." * 40, step_delay_s=0.02)
    app = make_app(tokenizer, runner)
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        await leave_mid_stream(client, path, body, marker)
        steps = runner.num_steps
        await drained(app)
        assert runner.num_steps - steps <= 2  # the step in flight, and at most one more
        text = (await client.get("/metrics")).text
        assert metric(text, "orca:http_requests_total", route=path, method="POST", status="200") == 1


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


async def greedy_through_loop(
    executor: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    config: SchedulerConfig | None = None,
    engine: IterationLoop | None = None,
) -> list[list[int]]:
    """Each prompt's greedy tokens (ignore_eos), all prompts at once through a real IterationLoop."""
    engine = engine or IterationLoop(executor, config)
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: Sequence[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(prompt, params, f"req-{i}"):
            assert delta.error is None, delta.error
            tokens += delta.token_ids
        return tokens

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.shutdown()


# --- a real `python -m server` process ----------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
# The parity setting (as builders.cpu_engine_config): the model and its KV cache in float32.
TINY_SERVER_FLAGS = (
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "float32",
    "--device",
    "cpu",
    "--num-kv-blocks",
    "512",
)


def server_process(model: str, log: Path, served_name: str, *flags: str) -> Iterator[str]:
    """`python -m server` on a free port until the generator is closed; yields its base URL once
    /health says 200 (for module-scoped fixtures: `yield from server_process(...)`)."""
    port = free_tcp_port()
    # Stored /v1/responses stay in memory unless a test names a file (not in the user's cache).
    cmd = [
        sys.executable, "-m", "server", "--model", model, "--served-model-name", served_name,
        "--port", str(port), "--log-level", "warning", "--responses-store", ":memory:", *flags,
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{LOOPBACK}:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SERVER_START_TIMEOUT_S = 180.0  # a model load on a loaded 2-core machine


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Poll /health until 200 (503 meanwhile, while the model loads). Fails if the process dies."""
    import pytest

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            r = httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:
            return False
        if r.status_code == 200:
            return True
        assert r.status_code == 503 and "error" in r.json(), r.text  # still loading
        return False

    try:
        wait_for(healthy, SERVER_START_TIMEOUT_S, poll_s=0.1)
    except AssertionError:
        pytest.fail(f"server never became healthy:\n{log.read_text()}")


def cramped_runner(
    longest: int, block_size: int, extra_blocks: int, kv_window: int | None = None
) -> fake_runner.FakeRunner:
    """A fake runner whose KV cache holds the longest sequence plus `extra_blocks` (few: preemption and
    eviction are common), speculating with a mostly-right draft where a config turns speculation on;
    `kv_window`: every layer's sliding window (blocks behind it are given back)."""
    from scheduler.block_allocator import blocks_for_tokens

    num_blocks = blocks_for_tokens(longest, block_size) + extra_blocks
    return fake_runner.FakeRunner(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=num_blocks * block_size,
        draft_fn=fake_runner.mostly_right_draft,
        kv_window=kv_window,
    )
