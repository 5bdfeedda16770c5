"""Who may call what: API keys (one, several, from a file or the environment), CORS, and no request
that can make the server load a model."""

from __future__ import annotations

from fakes import (
    MODEL,
    FakeRunner,
    error_of,
    fake_loader,
    make_app,
    running_app,
    server_config,
)

from server.app import create_app
from server.cli import parse_args


async def test_api_key(tokenizer):
    app = create_app(server_config(model=MODEL, api_key="s3cret"), fake_loader(tokenizer, FakeRunner()))
    async with running_app(app) as client:
        req = {"prompt": "a", "max_tokens": 1}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            err = error_of(await client.post("/v1/completions", json=req, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer s3cret"}
        assert (await client.post("/v1/completions", json=req, headers=ok)).status_code == 200
        error_of(await client.get("/v1/models"), 401)
        error_of(await client.post("/tokenize", json={"prompt": "a"}), 401)
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        # Probes and scrapers need no key.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        # A wrong key beats a bad body: no validation details leak to unauthenticated callers.
        error_of(await client.post("/v1/completions", json={"temperature": 9}), 401)


async def test_several_api_keys_on_every_route_but_health_and_metrics(tokenizer, tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfile-key-1\n\nfile-key-2\n")
    monkeypatch.setenv("ORCA_API_KEY", "env-key")
    cfg = parse_args(["--api-key", "flag-key", "--api-key-file", str(key_file), "--model", MODEL])
    assert cfg.all_api_keys == ("flag-key", "env-key", "file-key-1", "file-key-2")
    assert "key" not in repr(cfg).replace("api_key", "")  # no secret in reprs / logs
    app = create_app(
        server_config(model=MODEL, api_key=cfg.api_key, api_keys=cfg.api_keys, log_stats_interval_s=0),
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

    app = create_app(server_config(model=MODEL, log_stats_interval_s=0), counting_loader)
    async with running_app(app) as client:
        for name in ("/etc/passwd", "default", "~/model.gguf", "http://x/y"):
            r = await client.post("/v1/completions", json={"prompt": "a", "model": name})
            assert error_of(r, 404)["code"] == "model_not_found"
            assert error_of(await client.get(f"/v1/models/{name}"), 404)["code"] == "model_not_found"
    assert loads == [1]
