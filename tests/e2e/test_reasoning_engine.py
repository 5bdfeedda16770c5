"""--reasoning-parser through the real engine: the tiny random Llama behind a Qwen3-like chat template
(tests/fakes.py THINKING_TEMPLATE), so the thinking grammar's masks run in the sampler. A random model
never closes its thinking by chance, so these check what holds whatever it writes: streamed equals
non-streamed, the thinking is returned apart, and with the thinking turned off in the template the
answer is the schema's (the exact grammar behaviour is tested with llguidance in
tests/server/test_reasoning.py)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from builders import build_hf_model, tiny_llama_config
from fakes import THINKING_TEMPLATE, live_server, server_config

from server.app import create_app
from server.loader import load_served_model

SCHEMA = {
    "type": "object",
    "properties": {"sky": {"enum": ["clear", "cloudy"]}},
    "required": ["sky"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def thinking_llama_dir(tmp_path_factory, smollm2_tokenizer_dir):
    out = tmp_path_factory.mktemp("thinking-llama")
    build_hf_model(tiny_llama_config()).save_pretrained(out, safe_serialization=True)
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


async def test_thinking_grammar_runs_in_the_engine(thinking_llama_dir):
    config = server_config(
        model=str(thinking_llama_dir),
        served_model_name="m",
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        reasoning_parser="qwen3",
        log_stats_interval_s=0,
    )
    app = create_app(config, lambda: load_served_model(config))
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as client:
        user = [{"role": "user", "content": "Is the sky clear?"}]
        # reasoning_effort "high": the template opens the thinking, so the reply must think first.
        body = {"model": "m", "messages": user, "max_tokens": 24, "temperature": 0, "response_format": FORMAT}
        opened = {**body, "reasoning_effort": "high"}
        whole = (await client.post("/v1/chat/completions", json=opened)).json()["choices"][0]
        assert whole["finish_reason"] == "length" and whole["message"]["reasoning_content"]
        r = await client.post("/v1/chat/completions", json={**opened, "stream": True})
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in r.text.splitlines()
            if line.startswith("data: {")
        ]
        assert (
            "".join(d.get("reasoning_content", "") for d in deltas) == whole["message"]["reasoning_content"]
        )
        assert "".join(d.get("content", "") for d in deltas) == (whole["message"]["content"] or "")
        # The template closes the thinking itself: the grammar is the schema's alone, and the answer parses.
        closed = {**body, "max_tokens": 100, "chat_template_kwargs": {"enable_thinking": False}}
        answer = (await client.post("/v1/chat/completions", json=closed)).json()["choices"][0]
        assert answer["finish_reason"] == "stop" and "reasoning_content" not in answer["message"]
        assert json.loads(answer["message"]["content"])["sky"] in ("clear", "cloudy")
