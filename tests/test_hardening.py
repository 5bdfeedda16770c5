"""Production hardening, tried as a careless or hostile client would: overload (bounded queue, 429,
timeouts), faults (disconnect storms, failing steps, a dead loop), bad input, security, metrics.

Every test drives the real AsyncEngine with the fake runner; nothing waits on a clock: the runner's
gate holds a step "in flight" and wait_until polls for states.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from fakes import FakeRunner, fake_loader, live_server, parse_sse, running_app, wait_until
from prometheus_client.parser import text_string_to_metric_families

from engine.batch import SampledToken, ScheduledSequence
from server.app import create_app
from server.cli import parse_args
from server.config import ServerConfig
from server.middleware import RequestIdFilter
from server.tokenizer import ServerTokenizer

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]
MARKED = 4242  # a prompt holding this token id makes FailingRunner's step raise


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir) -> ServerTokenizer:
    return ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


def make_app(tokenizer: ServerTokenizer, runner: FakeRunner | None = None, **config):
    return create_app(
        ServerConfig(model=MODEL, log_stats_interval_s=0, **config),
        fake_loader(tokenizer, runner or FakeRunner()),
    )


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus exposition `text` (summed over labels not given)."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


@contextlib.asynccontextmanager
async def serving(app, runner: FakeRunner) -> AsyncIterator[httpx.AsyncClient]:
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


def engine_of(app):
    return app.state.server.engine


async def drained(app) -> None:
    """Until the loop holds no request and no KV block."""
    engine = engine_of(app)

    def idle() -> bool:
        s = engine.stats()
        return s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0

    await wait_until(idle)


# --- 1. overload ---------------------------------------------------------------------------------


async def test_queue_bound_answers_429_with_retry_after(tokenizer):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=3, max_num_seqs=1, retry_after_s=2)
    async with serving(app, runner) as client:
        engine = engine_of(app)
        runner.gate.clear()  # the first request's step stays in flight; the others wait
        req = {"prompt": "hello", "max_tokens": 2}
        first = asyncio.create_task(client.post("/v1/completions", json=req))
        await wait_until(lambda: engine.stats().running == 1)
        queued = [asyncio.create_task(client.post("/v1/completions", json=req)) for _ in range(3)]
        await wait_until(lambda: engine.stats().waiting == 3)
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        err = error_of(r, 429)
        assert err["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "2"
        # A request for several choices counts each of them.
        err = error_of(await client.post("/v1/completions", json={**req, "n": 2}), 429)
        runner.gate.set()
        for r in await asyncio.gather(first, *queued):
            assert r.status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, "orca:requests_rejected_total", reason="queue_full") == 2
        # Served again once the queue has room.
        assert (await client.post("/v1/completions", json=req)).status_code == 200


async def test_flood_keeps_memory_bounded(tokenizer):
    """300 concurrent requests against a queue of 8: the loop never holds more than max_num_seqs + 8
    requests, the rest get 429, and afterwards nothing is left behind."""
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=8, max_num_seqs=4)
    async with serving(app, runner) as client:
        engine = engine_of(app)
        runner.gate.clear()
        peak = 0

        def watch() -> None:
            nonlocal peak
            s = engine.stats()
            peak = max(peak, s.running + s.waiting, len(engine._scheduler.requests))

        engine.add_step_listener(lambda _: watch())
        req = {"prompt": "flood", "max_tokens": 3, "stream": True}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=req)) for _ in range(300)]
        await wait_until(lambda: sum(t.done() for t in tasks) >= 300 - 12)
        watch()
        runner.gate.set()
        codes = [r.status_code for r in await asyncio.gather(*tasks)]
        assert set(codes) == {200, 429}
        assert codes.count(200) <= 4 + 8 and peak <= 4 + 8
        await drained(app)
        assert not engine._queues and not engine._scheduler.requests


async def test_request_timeout_is_408_and_frees_blocks(tokenizer):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, request_timeout_s=0.05)
    async with serving(app, runner) as client:
        runner.gate.clear()  # the step never ends while the gate is closed: the deadline must fire
        err = error_of(await client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 5}), 408)
        assert err["code"] == "request_timeout"
        r = await client.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stream": True}
        )
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        runner.gate.set()
        await drained(app)
        text = (await client.get("/metrics")).text
        assert metric(text, "orca:requests_rejected_total", reason="timeout") == 2
        assert metric(text, "vllm:kv_cache_usage_perc") == 0


# --- 2. faults -----------------------------------------------------------------------------------


async def test_disconnect_storm_frees_every_block(tokenizer):
    """Clients that leave before their first token and in mid-stream, over real sockets."""
    runner = FakeRunner(num_kv_blocks=512)
    app = make_app(tokenizer, runner)
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        engine = engine_of(app)
        long = {"prompt": "storm", "max_tokens": 200, "ignore_eos": True, "stream": True}

        async def leave_before_first_token() -> None:
            async with client.stream("POST", "/v1/completions", json=long) as r:
                assert r.status_code == 200  # headers only: the step is held at the gate

        async def leave_mid_stream(chunks: int) -> None:
            async with client.stream("POST", "/v1/chat/completions", json={**long, "messages": CHAT}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen >= chunks:
                        return

        runner.gate.clear()
        await asyncio.gather(*(leave_before_first_token() for _ in range(16)))
        runner.gate.set()
        await asyncio.gather(*(leave_mid_stream(2 + i % 5) for i in range(24)))
        # Non-streamed requests cancelled while they run.
        posts = [
            asyncio.create_task(client.post("/v1/completions", json={**long, "stream": False}))
            for _ in range(8)
        ]
        await wait_until(lambda: engine.stats().kv_blocks_used > 0)
        for t in posts:
            t.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        await drained(app)
        text = (await client.get("/metrics")).text
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert metric(text, "vllm:num_requests_running") == 0
        r = await client.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


class FailingRunner(FakeRunner):
    """Raises inside the model step whenever a marked request is in the batch."""

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        if any(MARKED in seq.prompt_token_ids for seq in batch):
            super().step([])  # keep the step counter and gate behaviour
            raise RuntimeError("injected failure in the model step")
        return super().step(batch)


async def test_step_exception_fails_only_that_step(tokenizer):
    app = make_app(tokenizer, FailingRunner())
    async with running_app(app) as client:
        err = error_of(
            await client.post("/v1/completions", json={"prompt": [MARKED, 5], "max_tokens": 3}), 500
        )
        assert err["code"] == "generation_failed" and "injected failure" in err["message"]
        r = await client.post(
            "/v1/completions", json={"prompt": [5, MARKED], "max_tokens": 3, "stream": True}
        )
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "generation_failed"
        # The server goes on serving.
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        await drained(app)


async def test_loop_death_turns_health_503_and_errors_waiting_clients(tokenizer, monkeypatch):
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    async with serving(app, runner) as client:
        engine = engine_of(app)
        runner.gate.clear()
        req = {"prompt": "doomed", "max_tokens": 50, "ignore_eos": True}
        stream = asyncio.create_task(client.post("/v1/completions", json={**req, "stream": True}))
        plain = asyncio.create_task(client.post("/v1/completions", json=req))
        await wait_until(lambda: engine.stats().running + engine.stats().waiting == 2)

        def broken_schedule():
            raise RuntimeError("scheduler bug outside the step")

        monkeypatch.setattr(engine._scheduler, "schedule", broken_schedule)
        runner.gate.set()  # the step in flight ends; the next turn of the loop dies
        events = parse_sse((await stream).text)
        assert events[-1] == "[DONE]" and "scheduler bug" in events[-2]["error"]["message"]
        assert "scheduler bug" in error_of(await plain, 500)["message"]
        err = error_of(await client.get("/health"), 503)
        assert err["code"] == "engine_dead"
        error_of(await client.post("/v1/completions", json=req), 503)


# --- 3. bad input --------------------------------------------------------------------------------


@pytest.fixture
async def client(tokenizer):
    async with running_app(make_app(tokenizer, FakeRunner(max_model_len=256), max_body_bytes=4096)) as c:
        yield c


async def test_body_over_limit_is_413(client):
    big = {"prompt": "x" * 5000}
    assert error_of(await client.post("/v1/completions", json=big), 413)["code"] == "payload_too_large"

    async def chunked():  # no Content-Length: the limit is applied while the body arrives
        for _ in range(10):
            yield b"[" + b"1," * 500

    err = error_of(await client.post("/v1/completions", content=chunked()), 413)
    assert err["code"] == "payload_too_large"
    r = await client.post("/v1/completions", content=b"{}", headers={"content-length": "abc"})
    assert r.status_code in (400, 413)


BAD_BODIES = [
    (b'{"prompt": "hi", ', None),  # truncated JSON
    (b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
    (b"[1, 2, 3]", None),  # an array, not an object
    (b'"just a string"', None),
    (b"", None),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": "warm"}', "temperature"),
    (b'{"prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias.5"),
]


@pytest.mark.parametrize(("raw", "param"), BAD_BODIES)
async def test_malformed_bodies_are_400(client, raw, param):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


BAD_COMPLETIONS = [
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "max_tokens": -5},
    {"prompt": "hi", "max_tokens": 10**12},
    {"prompt": "hi", "max_tokens": 10**30},
    {"prompt": "hi", "n": 10**9},
    {"prompt": "hi", "n": 17},  # over the server's max_n (16)
    {"prompt": ["a"] * 20, "n": 4},  # 80 choices > max_choices (64)
    {"prompt": [0, 49152]},  # one past the vocabulary
    {"prompt": [-1, 5]},
    {"prompt": [[5], [10**9]]},
    {"prompt": "hi", "stop_token_ids": [10**6]},
    {"prompt": "hi", "logit_bias": {"10000000": 1}},
    {"prompt": "hi", "logprobs": 10**6},
    {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "hi", "model": "/etc/passwd"},
    {"prompt": "hi", "model": "../../models/other"},
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS)
async def test_bad_completion_requests_are_4xx(client, body):
    r = await client.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500
    error_of(r, r.status_code)


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"content": "hi"}]},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}]},
    {"messages": CHAT, "max_tokens": 0},
    {"messages": CHAT, "max_completion_tokens": -1},
    {"messages": CHAT, "n": 100},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 99},
    {"messages": CHAT, "temperature": "hot"},
    {"messages": CHAT, "model": "/tmp/evil.gguf"},
]


@pytest.mark.parametrize("body", BAD_CHATS)
async def test_bad_chat_requests_are_4xx(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500
    error_of(r, r.status_code)


async def test_unknown_fields_are_ignored_and_logged_once(client, caplog):
    body = {"prompt": "hi", "max_tokens": 1, "frobnicate_xyz": True, "stream_options_typo": 1}
    with caplog.at_level(logging.WARNING, logger="server.protocol"):
        for _ in range(3):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "frobnicate_xyz" in r.getMessage()]
    assert len(lines) == 1 and "ignoring unknown field" in lines[0]


# --- 4. security ---------------------------------------------------------------------------------


async def test_several_api_keys_on_every_route_but_health_and_metrics(tokenizer, tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfile-key-1\n\nfile-key-2\n")
    monkeypatch.setenv("ORCA_API_KEY", "env-key")
    cfg = parse_args(["--api-key", "flag-key", "--api-key-file", str(key_file), "--model", MODEL])
    assert cfg.all_api_keys == ("flag-key", "env-key", "file-key-1", "file-key-2")
    assert "key" not in repr(cfg).replace("api_key", "")  # no secret in reprs / logs
    app = create_app(
        ServerConfig(model=MODEL, api_key=cfg.api_key, api_keys=cfg.api_keys, log_stats_interval_s=0),
        fake_loader(tokenizer, FakeRunner()),
    )
    async with running_app(app) as client:
        for path in ("/v1/models", "/openapi.json", "/docs", "/no-such-route"):
            assert error_of(await client.get(path), 401)["code"] == "invalid_api_key"
        for key in cfg.all_api_keys:
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        for bad in ("Bearer file-key", "Bearer file-key-1x", "Token file-key-1", "Bearer "):
            error_of(await client.get("/openapi.json", headers={"Authorization": bad}), 401)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_cors_off_by_default_and_on_for_allowed_origins(tokenizer):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    async with running_app(make_app(tokenizer)) as client:
        r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = await client.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    app = make_app(tokenizer, allowed_origins=("https://ok.example",), api_key="k")
    async with running_app(app) as client:
        ok = {**preflight, "Origin": "https://ok.example"}
        r = await client.options("/v1/completions", headers=ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
        r = await client.options("/v1/completions", headers=preflight)
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
        # A 401 is readable by the allowed page (CORS outside the key check).
        r = await client.get("/v1/models", headers={"Origin": "https://ok.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ok.example"


async def test_no_request_can_load_a_model(tokenizer):
    loads = []
    runner = FakeRunner()
    base = fake_loader(tokenizer, runner)

    def counting_loader():
        loads.append(1)
        return base()

    app = create_app(ServerConfig(model=MODEL, log_stats_interval_s=0), counting_loader)
    async with running_app(app) as client:
        for name in ("/etc/passwd", "default", "~/model.gguf", "http://x/y"):
            r = await client.post("/v1/completions", json={"prompt": "a", "model": name})
            assert error_of(r, 404)["code"] == "model_not_found"
            assert error_of(await client.get(f"/v1/models/{name}"), 404)["code"] == "model_not_found"
    assert loads == [1]


# --- 5. observability ----------------------------------------------------------------------------

VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:iteration_tokens_total_count",
]


async def test_metrics_use_vllm_names(client):
    for stream in (False, True):
        body = {"prompt": "hello", "max_tokens": 4, "stream": stream}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    text = (await client.get("/metrics")).text
    for name in VLLM_NAMES:
        metric(text, name, model_name=MODEL)
    assert metric(text, "vllm:request_queue_time_seconds_count") == 2
    assert metric(text, "vllm:generation_tokens_total") == 8


async def test_request_id_in_every_log_line_about_a_request(tokenizer, caplog):
    runner = FakeRunner()
    app = make_app(tokenizer, runner, max_queue_len=1, max_num_seqs=1)
    caplog.handler.addFilter(RequestIdFilter())
    async with serving(app, runner) as client:
        runner.gate.clear()
        engine = engine_of(app)
        req = {"prompt": "a", "max_tokens": 1}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=req))]
        await wait_until(lambda: engine.stats().running == 1)
        tasks.append(asyncio.create_task(client.post("/v1/completions", json=req)))
        await wait_until(lambda: engine.stats().waiting == 1)
        with caplog.at_level(logging.INFO):
            r = await client.post(
                "/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "abc-123"}
            )
        assert r.status_code == 429 and r.headers["x-request-id"] == "abc-123"
        runner.gate.set()
        await asyncio.gather(*tasks)
        # An id that could forge log lines is replaced.
        r = await client.get("/health", headers={"X-Request-Id": "x\nFAKE LOG LINE"})
        assert r.headers["x-request-id"] != "x\nFAKE LOG LINE" and len(r.headers["x-request-id"]) == 32
    [line] = [rec for rec in caplog.records if "queue full" in rec.getMessage()]
    assert line.request_id == "abc-123"
    # The access log line is written inside the request too, so it carries the same id.
    [access] = [rec for rec in caplog.records if rec.name == "server.access" and rec.request_id == "abc-123"]
    assert "POST /v1/completions 429" in access.getMessage()


async def test_periodic_stats_line(tokenizer):
    from server.stats_log import StatsLogger

    app = make_app(tokenizer)
    async with running_app(app) as client:
        state = app.state.server
        stats_logger = StatsLogger(state.metrics, state._stats)
        assert stats_logger.line() is None  # the first call only sets the mark
        assert stats_logger.line() is None  # idle: quiet
        assert (
            await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        ).status_code == 200
        line = stats_logger.line()
        assert line is not None
        for part in (
            "Avg prompt throughput",
            "Avg generation throughput",
            "Running: 0 reqs",
            "KV cache usage",
        ):
            assert part in line


# --- the loop's queue time (scheduler.outputs.RequestDelta.queue_time_s) -------------------------


async def test_queue_time_on_the_first_delta_only():
    from engine.batch import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.fake_runner import FakeRunner as LoopRunner
    from scheduler.loop import AsyncEngine

    engine = AsyncEngine(LoopRunner(), SchedulerConfig(max_num_seqs=1))
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        streams = [engine.generate([5, 6, 7], params, f"r{i}") for i in range(2)]

        async def deltas(stream):
            return [d async for d in stream]

        first, second = await asyncio.wait_for(asyncio.gather(*map(deltas, streams)), 20)
        for ds in (first, second):
            assert ds[0].queue_time_s is not None and ds[0].queue_time_s >= 0
            assert all(d.queue_time_s is None for d in ds[1:])
        # max_num_seqs=1: the second request waited for the whole first one.
        assert second[0].queue_time_s >= first[0].queue_time_s
    finally:
        await engine.shutdown()


# --- the soak script, briefly, against the fake runner ---------------------------------------------


async def test_soak_reports_and_leaves_no_blocks(tokenizer, smollm2_tokenizer_dir):
    from loadtest.soak import Soak, build_parser

    runner = FakeRunner(num_kv_blocks=512)
    app = make_app(tokenizer, runner)
    async with live_server(app) as url:
        args = build_parser().parse_args(
            ["--duration", "1.5", "--concurrency", "6", "--tokenizer", str(smollm2_tokenizer_dir)]
            + ["--input-max", "64", "--output-max", "24", "--disconnect", "0.4"]
        )
        report = await Soak(args, url, None, MODEL).run()
    assert report.requests_served > 0 and report.disconnects > 0
    assert report.requests_sent >= report.requests_served + report.disconnects
    assert report.errors == {}
    assert report.kv_blocks_used_end == 0 and report.requests_running_end == 0
    assert any(line.startswith("KV blocks in use at the end: 0") for line in report.lines())


# --- stop strings: the cut must not depend on how text is chunked (a lagging client) -------------


@pytest.mark.parametrize("chunks", [["aba"], ["ab", "a"], ["a", "b", "a"], ["a", "ba"]])
def test_stop_cut_is_the_same_for_every_chunking(chunks):
    from server.stop import StopStringMatcher

    m = StopStringMatcher(["b", "aba"])
    out = "".join(m.feed(c) for c in chunks)
    assert (out, m.matched) == ("", "aba")  # "aba" starts first, though "b" completes first


def test_stop_that_completed_while_a_longer_one_was_pending_is_applied_at_the_end():
    from server.stop import StopStringMatcher

    m = StopStringMatcher(["b", "aba"])
    assert m.feed("ab") == "" and m.matched is None  # "aba" may still come
    assert m.flush() == "a" and m.matched == "b"  # the text ended: "b" it is
