"""Start-up: 503 while the model loads and ready after, and a load failure reported by /health."""

from __future__ import annotations

import asyncio
import threading

from fakes import (
    MODEL,
    FakeRunner,
    error_of,
    live_server,
    running_app,
    server_config,
)

from server import healthcheck
from server.app import create_app
from server.state import LoadedModel

CHAT = [{"role": "user", "content": "hi"}]


async def test_503_while_loading_then_ready(tokenizer):
    release = threading.Event()
    runner = FakeRunner()

    def slow_loader() -> LoadedModel:
        release.wait(timeout=30)
        return LoadedModel(runner, tokenizer, runner.vocab_size)

    app = create_app(server_config(model=MODEL), slow_loader)
    async with running_app(app, wait=False) as client:
        err = error_of(await client.get("/health"), 503)
        assert err["code"] == "model_not_ready"
        for method, path, body in (
            ("POST", "/v1/completions", {"prompt": "a"}),
            ("POST", "/v1/chat/completions", {"messages": CHAT}),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "a"}),
        ):
            error_of(await client.request(method, path, json=body), 503)
        assert (await client.get("/metrics")).status_code == 200
        release.set()
        await app.state.server.wait_ready()
        health = (await client.get("/health")).json()
        assert health["status"] == "ok"
        kv = health["kv_cache"]  # the capacity the KV cache's type and memory give
        assert kv["dtype"] and kv["tokens"] == kv["blocks"] * kv["block_size"] > 0


async def test_the_container_health_check_follows_health(tokenizer):
    """`python -m server.healthcheck` (the images' HEALTHCHECK): 0 while /health says ok, 1 while it
    says 503 (here: the model failed to load) or nothing listens."""
    runner = FakeRunner()

    def broken_loader() -> LoadedModel:
        raise FileNotFoundError("no such model: /nowhere")

    ready = create_app(server_config(model=MODEL), lambda: LoadedModel(runner, tokenizer, runner.vocab_size))
    async with live_server(ready) as url:
        assert await asyncio.to_thread(healthcheck.main, [f"{url}/health"]) == 0
    assert healthcheck.main([f"{url}/health"]) == 1
    async with live_server(create_app(server_config(model="/nowhere"), broken_loader)) as url:
        assert await asyncio.to_thread(healthcheck.main, [f"{url}/health"]) == 1


async def test_load_failure_reported_by_health():
    def broken_loader() -> LoadedModel:
        raise FileNotFoundError("no such model: /nowhere")

    app = create_app(server_config(model="/nowhere"), broken_loader)
    failures: list[str] = []
    app.state.server.on_load_failed = failures.append
    async with running_app(app) as client:
        err = error_of(await client.get("/health"), 503)
        assert err["code"] == "model_load_failed" and "/nowhere" in err["message"]
        assert failures and "/nowhere" in failures[0]


async def test_a_bad_model_file_is_logged_without_a_traceback(caplog):
    from models.errors import ModelLoadError

    def broken_loader() -> LoadedModel:
        raise ModelLoadError("/m.gguf: unsupported GGUF architecture 'rwkv7'; supported: llama, ...")

    app = create_app(server_config(model="/m.gguf"), broken_loader)
    async with running_app(app) as client:
        err = error_of(await client.get("/health"), 503)
    assert "unsupported GGUF architecture 'rwkv7'" in err["message"]
    [record] = [r for r in caplog.records if "loading the model failed" in r.getMessage()]
    assert "rwkv7" in record.getMessage() and record.exc_info is None


async def test_the_model_is_built_in_the_thread_its_steps_run_in(tokenizer):
    loaded_in: list[str] = []
    stepped_in: set[str] = set()

    class Recording(FakeRunner):
        def step(self, batch):
            stepped_in.add(threading.current_thread().name)
            return super().step(batch)

    def loader() -> LoadedModel:
        loaded_in.append(threading.current_thread().name)
        runner = Recording()
        return LoadedModel(runner, tokenizer, runner.vocab_size)

    async with running_app(create_app(server_config(model=MODEL), loader)) as client:
        r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
    assert stepped_in == set(loaded_in) and loaded_in[0].startswith("orca-step")
