"""Every error the API documents, in OpenAI's shape: 400 (never 422) for bad parameters, 404, context
length, chat templates that cannot render."""

from __future__ import annotations

import pytest
from fakes import (
    MODEL,
    FakeRunner,
    error_of,
    fake_loader,
    running_app,
    server_config,
)

from server.app import create_app
from server.tokenizer import ServerTokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(tokenizer):
    app = create_app(server_config(model=MODEL), fake_loader(tokenizer, FakeRunner(max_model_len=256)))
    async with running_app(app) as c:
        yield c


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
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # no tool_call_id
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
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
        "tools.0.function.parameters",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format",
    ),
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
    app = create_app(server_config(model=MODEL), fake_loader(tok, FakeRunner()))
    async with running_app(app) as client:
        err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT}))
        assert "chat template" in err["message"] and err["code"] == "chat_template_missing"
        assert (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        ).status_code == 200


async def test_chat_template_rejecting_messages_is_400(smollm2_tokenizer_dir):
    tok = ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    tok.hf.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    app = create_app(server_config(model=MODEL), fake_loader(tok, FakeRunner()))
    async with running_app(app) as client:
        err = error_of(await client.post("/v1/chat/completions", json={"messages": CHAT}))
        assert "Conversation roles must alternate" in err["message"]
