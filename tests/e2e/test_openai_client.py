"""A real `python -m server` process on the tiny Llama, driven by the official openai client (sync and
async, streaming and not, both endpoints) and by the README's own examples, run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fakes import TINY_SERVER_FLAGS, parse_sse, server_process

from engine.ports import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "default"  # the README's examples name the model as `make serve` serves it
MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server_url(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    yield from server_process(str(tiny_llama_dir), log, MODEL, *TINY_SERVER_FLAGS)


@pytest.fixture
def client(server_url):
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused") as c:
        yield c


def test_sync_completions(client):
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == c.choices[0].text
    lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 3 and len(lp.choices[0].logprobs.top_logprobs) == 3


def test_sync_chat(client):
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, n=2)
    assert chat.object == "chat.completion" and [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    texts: dict[int, str] = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8, temperature=0, n=2, stream=True
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add((ch.index, ch.delta.role))
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    lp = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    assert len(lp.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)


def test_chat_next_turn_reports_cached_tokens(client):
    """A conversation's second turn resends the first: the official client reads the reused part in
    usage.prompt_tokens_details.cached_tokens, streamed or not."""
    history = [{"role": "system", "content": "You are a terse assistant. " * 12}, *MSGS]
    turn1 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    assert turn1.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": turn1.choices[0].message.content}]
    history += [{"role": "user", "content": "Go on."}]
    turn2 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    assert turn1.usage.prompt_tokens // 16 * 16 <= turn2.usage.prompt_tokens_details.cached_tokens
    assert turn2.usage.prompt_tokens_details.cached_tokens < turn2.usage.prompt_tokens
    usage_too = {"include_usage": True}
    stream = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=6, temperature=0, stream=True, stream_options=usage_too
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= turn2.usage.prompt_tokens_details.cached_tokens


def test_sync_errors(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="missing", prompt="x")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=7)


async def test_async_client_against_process(server_url):
    async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused") as client:
        chat = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=5, temperature=0, stream=True
        )
        text = "".join([ch.delta.content or "" async for chunk in stream for ch in chunk.choices])
        assert text == chat.choices[0].message.content
        c = await client.completions.create(model=MODEL, prompt=[[520, 9531], [198]], max_tokens=2)
        assert len(c.choices) == 2


def test_raw_sse_over_http(server_url):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.rstrip().endswith("data: [DONE]")
    events = parse_sse(raw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def _readme_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_curl_examples(server_url):
    port = server_url.rsplit(":", 1)[1]
    commands = []
    for block in _readme_blocks("bash"):
        # Join continuation lines; keep only the curl commands (not `make serve`).
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("curl "):
                commands.append(line.strip().replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    assert len(commands) >= 4
    for cmd in commands:
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr)
        if '"stream": true' in cmd:
            events = parse_sse(out.stdout)
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), out.stdout
        else:
            body = json.loads(out.stdout)
            assert "error" not in body, body


def test_readme_python_examples(server_url, capsys):
    blocks = _readme_blocks("python")
    assert len(blocks) >= 2  # the openai client's, and the anthropic client's
    for block in blocks:
        code = block.replace("http://127.0.0.1:8000", server_url)
        exec(compile(code, "README.md", "exec"), {})
        assert capsys.readouterr().out.strip()


def test_unloadable_model_exits_nonzero(tmp_path):
    # A server that cannot load its model must not linger answering 503s: it exits with status 1.
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(tmp_path / "missing"),
        "--port",
        str(free_tcp_port()),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert "missing" in out.stderr
