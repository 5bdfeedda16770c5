"""A real `python -m server` process on a tiny Qwen3-Embedding-like model (a random Qwen3 with
sentence-transformers' last-token Pooling module) driven by the official openai client:
`embeddings.create` with float and base64 (what the SDK returns and what the raw JSON holds), lists,
token ids and dimensions, each vector against transformers' float32 last-token state, normalised; and
/v1/rerank beside it."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from builders import sentence_transformers_dir
from fakes import TINY_SERVER_FLAGS, server_process

from models.loader import load_hf_model

MODEL = "tiny-embedder"


@pytest.fixture(scope="module")
def embedder_dir(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    shutil.copytree(tiny_qwen3_dir, out, dirs_exist_ok=True)
    return sentence_transformers_dir(out, lasttoken=True)


@pytest.fixture(scope="module")
def server_url(embedder_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    yield from server_process(str(embedder_dir), log, MODEL, *TINY_SERVER_FLAGS)


@pytest.fixture
def client(server_url: str):
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(embedder_dir: Path):
    """transformers' float32 last-token state of the final norm, cut to `dimensions`, normalised."""
    hf = load_hf_model(embedder_dir, torch.float32)

    def embed(ids: list[int], dimensions: int | None = None) -> np.ndarray:
        with torch.inference_mode():
            state = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()[:dimensions]
        return state / np.linalg.norm(state)

    return embed


def test_float_and_base64(client: openai.OpenAI, server_url: str, reference, embedder_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(embedder_dir)("Hello there")["input_ids"]
    floats = client.embeddings.create(model=MODEL, input="Hello there", encoding_format="float")
    assert floats.model == MODEL and len(floats.data) == 1
    np.testing.assert_allclose(floats.data[0].embedding, reference(ids), atol=1e-5, rtol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == len(ids)
    decoded = client.embeddings.create(model=MODEL, input="Hello there")  # the SDK asks for base64
    assert decoded.data[0].embedding == floats.data[0].embedding
    raw = httpx.post(
        server_url + "/v1/embeddings",
        json={"model": MODEL, "input": "Hello there", "encoding_format": "base64"},
    ).json()
    values = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert values.tolist() == floats.data[0].embedding


def test_lists_token_ids_and_dimensions(client: openai.OpenAI, reference) -> None:
    prompts = [[7, 99, 3, 250, 18], [41, 5, 300], [12]]
    many = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2] and many.usage.prompt_tokens == 9
    for d, ids in zip(many.data, prompts, strict=True):
        np.testing.assert_allclose(d.embedding, reference(ids), atol=1e-5, rtol=1e-4)
    one = client.embeddings.create(model=MODEL, input=prompts[0], dimensions=8)
    assert len(one.data[0].embedding) == 8
    np.testing.assert_allclose(one.data[0].embedding, reference(prompts[0], 8), atol=1e-5, rtol=1e-4)
    texts = client.embeddings.create(model=MODEL, input=["a cat", "a dog"])
    assert len(texts.data) == 2 and texts.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=list(range(1, 10_000)))


def test_rerank(server_url: str) -> None:
    body = {"model": MODEL, "query": "a cat", "documents": ["a dog", "a cat", "the sea"], "top_n": 2}
    r = httpx.post(server_url + "/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert results[0]["document"] == {"text": "a cat"}
