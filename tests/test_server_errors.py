"""Every error the API documents, in OpenAI's shape: 400 (never 422) for bad input, 401, 404, 503."""

from __future__ import annotations

import threading

import pytest
from fakes import FakeRunner, fake_loader, running_app

from server.app import create_app
from server.config import ServerConfig
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir) -> ServerTokenizer:
    return ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture
async def client(tokenizer):
    app = create_app(ServerConfig(model=MODEL), fake_loader(tokenizer, FakeRunner(max_model_len=256)))
    async with running_app(app) as c:
        yield c


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


COMPLETION_CASES = [
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"seed": "abc"}, "seed"),
    ({"stream": [1]}, "stream"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, 10**7]}, "prompt"),
    ({"suffix": "and then"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("extra", "param"), COMPLETION_CASES)
async def test_completion_invalid_values(client, extra, param):
    err = error_of(await client.post("/v1/completions", json={"prompt": "hi", **extra}))
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


async def test_unsupported_features_say_so(client):
    assert (
        "not supported"
        in error_of(await client.post("/v1/completions", json={"prompt": "a", "suffix": "b"}))["message"]
    )
    err = error_of(await client.post("/v1/completions", json={"prompt": "a", "best_of": 2}))
    assert "not supported" in err["message"]


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content.0",
    ),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 0}, "n"),
]


@pytest.mark.parametrize(("extra", "param"), CHAT_CASES)
async def test_chat_invalid_values(client, extra, param):
    err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT, **extra}))
    assert err["param"] == param


async def test_chat_accepts_text_response_format(client):
    r = await client.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "response_format": {"type": "text"}}
    )
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
async def test_invalid_json_and_non_object_bodies(client, path):
    headers = {"content-type": "application/json"}
    err = error_of(await client.post(path, content=b'{"prompt": "a",', headers=headers))
    assert err["code"] == "invalid_json"
    error_of(await client.post(path, content=b"[1, 2]", headers=headers))
    error_of(await client.post(path, content=b"not json at all"))


async def test_missing_required_fields(client):
    assert error_of(await client.post("/v1/completions", json={"max_tokens": 3}))["param"] == "prompt"
    assert error_of(await client.post("/v1/chat/completions", json={"model": MODEL}))["param"] == "messages"


async def test_unknown_model_is_404(client):
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = error_of(await client.post(path, json={**body, "model": "gpt-17"}), 404)
        assert (
            err["type"] == "invalid_request_error"
            and err["code"] == "model_not_found"
            and err["param"] == "model"
        )


async def test_context_length_exceeded(client):
    long_prompt = "word " * 300
    err = error_of(await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 16}))
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested "
    )
    assert err["message"].endswith(
        "in the completion). Please reduce the length of the messages or completion."
    )
    r = await client.post("/tokenize", json={"messages": CHAT})
    prompt_tokens = r.json()["count"]
    err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 250}))
    assert err["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt_tokens + 250} tokens "
        f"({prompt_tokens} in the messages, 250 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    # The prompt alone too long, with no max_tokens: still the same error. Prompts this long (over
    # OFFLOAD_CHARS) are tokenized in a worker thread, so this also covers that path.
    huge = "word " * 1000
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"prompt": huge}),
    ):
        err = error_of(await client.post(path, json=body))
        assert err["code"] == "context_length_exceeded"


async def test_unknown_route_and_method(client):
    err = error_of(await client.get("/v1/nothing"), 404)
    assert err["type"] == "invalid_request_error"
    error_of(await client.get("/v1/completions"), 405)


async def test_chat_without_template(smollm2_tokenizer_dir):
    tok = ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    tok.hf.chat_template = None
    app = create_app(ServerConfig(model=MODEL), fake_loader(tok, FakeRunner()))
    async with running_app(app) as client:
        err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT}))
        assert "chat template" in err["message"] and err["code"] == "chat_template_missing"
        assert (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        ).status_code == 200


async def test_chat_template_rejecting_messages_is_400(smollm2_tokenizer_dir):
    tok = ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    tok.hf.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    app = create_app(ServerConfig(model=MODEL), fake_loader(tok, FakeRunner()))
    async with running_app(app) as client:
        err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT}))
        assert "Conversation roles must alternate" in err["message"]


# --- auth ---


async def test_api_key(tokenizer):
    app = create_app(ServerConfig(model=MODEL, api_key="s3cret"), fake_loader(tokenizer, FakeRunner()))
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


# --- loading ---


async def test_503_while_loading_then_ready(tokenizer):
    release = threading.Event()
    runner = FakeRunner()

    def slow_loader() -> LoadedModel:
        release.wait(timeout=30)
        return LoadedModel(runner, tokenizer, runner.vocab_size)

    app = create_app(ServerConfig(model=MODEL), slow_loader)
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
        assert (await client.get("/health")).json() == {"status": "ok"}


async def test_load_failure_reported_by_health():
    def broken_loader() -> LoadedModel:
        raise FileNotFoundError("no such model: /nowhere")

    app = create_app(ServerConfig(model="/nowhere"), broken_loader)
    failures: list[str] = []
    app.state.server.on_load_failed = failures.append
    async with running_app(app) as client:
        err = error_of(await client.get("/health"), 503)
        assert err["code"] == "model_load_failed" and "/nowhere" in err["message"]
        assert failures and "/nowhere" in failures[0]
