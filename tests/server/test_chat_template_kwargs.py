"""A chat request's `chat_template_kwargs` (vLLM's field) reach the chat template: Qwen3's
`{"enable_thinking": false}` renders the empty think block that switches its thinking off."""

from __future__ import annotations

import pytest
from fakes import FakeRunner, error_of, make_app, serving
from transformers import AutoTokenizer

from server.tokenizer import ServerTokenizer

# Qwen3's thinking switch, as its chat template writes it (the rest of the template trimmed).
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def qwen3_tokenizer(smollm2_tokenizer_dir) -> ServerTokenizer:
    hf = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    hf.chat_template = QWEN3_TEMPLATE
    return ServerTokenizer(hf)


@pytest.fixture
async def client(qwen3_tokenizer):
    runner = FakeRunner()
    async with serving(make_app(qwen3_tokenizer, runner), runner) as c:
        yield c


async def test_kwargs_reach_the_template(client, qwen3_tokenizer):
    off = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    thinking = (await client.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
    quiet = (await client.post("/tokenize", json=off)).json()["tokens"]
    assert qwen3_tokenizer.decode(quiet, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in qwen3_tokenizer.decode(thinking, skip_special_tokens=False)
    r = await client.post("/v1/chat/completions", json={**off, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(quiet)
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == len(thinking)


async def test_kwargs_may_not_set_the_servers_own_arguments(client):
    body = {"messages": CHAT, "chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False}}
    r = await client.post("/v1/chat/completions", json=body)
    err = error_of(r)
    assert err["param"] == "chat_template_kwargs" and "add_generation_prompt, tokenize" in err["message"]
    assert (await client.post("/tokenize", json=body)).status_code == 400
