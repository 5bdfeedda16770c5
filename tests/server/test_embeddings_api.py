"""/v1/embeddings with the official openai client (float and base64, as the SDK decodes it and as the
raw JSON carries it; string, list, token-id inputs; dimensions) and /v1/rerank (and its aliases) over
raw HTTP, over the fake runner: its made-up hidden states are pooled by the real loop, so each vector
is checked against what the fake model's states give. Bad input gets a 400 naming what is wrong, and
nothing leaks a KV block, errors and clients that leave included."""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import numpy as np
import openai
import pytest
from fakes import (
    MODEL,
    FakeRunner,
    drained,
    error_of,
    live_server,
    make_app,
    metric,
    running_app,
    server_config,
)
from waiting import wait_until

from models.pooling import ModelPooling
from server.app import create_app
from server.state import LoadedModel

HIDDEN = 16  # the fake runner's hidden size


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def expected(
    runner: FakeRunner, tokens: list[int], pooling: str = "last", dimensions: int | None = None
) -> np.ndarray:
    """The fake model's pooled states for `tokens`, cut to `dimensions` and L2-normalised."""
    states = np.array([runner.hidden_state(tokens[: i + 1]) for i in range(len(tokens))])
    v = {"last": states[-1], "mean": states.mean(axis=0), "cls": states[0]}[pooling][:dimensions]
    return v / np.linalg.norm(v)


async def test_float_and_base64_with_the_sdk(tokenizer) -> None:
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    tokens = tokenizer.encode("Hello there")
    async with live_server(app) as url, sdk(url) as client:
        floats = await client.embeddings.create(model=MODEL, input="Hello there", encoding_format="float")
        assert floats.object == "list" and floats.model == MODEL
        (item,) = floats.data
        assert item.object == "embedding" and item.index == 0 and len(item.embedding) == HIDDEN
        np.testing.assert_allclose(item.embedding, expected(runner, tokens), rtol=1e-6, atol=1e-7)
        assert floats.usage.prompt_tokens == len(tokens) and floats.usage.total_tokens == len(tokens)

        # No encoding_format: the SDK asks for base64 and decodes it (with numpy) into floats.
        decoded = await client.embeddings.create(model=MODEL, input="Hello there")
        assert decoded.data[0].embedding == item.embedding
        # The raw JSON: base64 of the little-endian float32 values.
        raw = await client.embeddings.with_raw_response.create(
            model=MODEL, input="Hello there", encoding_format="base64"
        )
        body = raw.http_response.json()
        b64 = body["data"][0]["embedding"]
        assert isinstance(b64, str)
        assert np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist() == item.embedding
        assert body["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
        await drained(app)


async def test_list_token_ids_and_dimensions_with_the_sdk(tokenizer) -> None:
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    texts = ["one", "two words", "and three words"]
    async with live_server(app) as url, sdk(url) as client:
        many = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
        assert [d.index for d in many.data] == [0, 1, 2]
        for d, text in zip(many.data, texts, strict=True):
            np.testing.assert_allclose(
                d.embedding, expected(runner, tokenizer.encode(text)), rtol=1e-6, atol=1e-7
            )
        assert many.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)

        ids = [101, 7, 99, 3000]
        one = await client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        np.testing.assert_allclose(one.data[0].embedding, expected(runner, ids), rtol=1e-6, atol=1e-7)
        assert one.usage.prompt_tokens == 4
        lists = await client.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float")
        assert lists.data[0].embedding == one.data[0].embedding
        np.testing.assert_allclose(lists.data[1].embedding, expected(runner, ids[:2]), rtol=1e-6, atol=1e-7)

        cut = await client.embeddings.create(model=MODEL, input=ids, dimensions=8)
        assert len(cut.data[0].embedding) == 8
        assert np.linalg.norm(cut.data[0].embedding) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(
            cut.data[0].embedding, expected(runner, ids, dimensions=8), rtol=1e-6, atol=1e-7
        )

        with pytest.raises(openai.BadRequestError) as too_wide:
            await client.embeddings.create(model=MODEL, input=ids, dimensions=HIDDEN + 1)
        assert too_wide.value.body["param"] == "dimensions" and str(HIDDEN) in too_wide.value.body["message"]
        await drained(app)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
async def test_the_pooling_flag(tokenizer, pooling: str) -> None:
    runner = FakeRunner()
    app = make_app(tokenizer, runner, pooling=pooling)
    ids = [55, 66, 77, 88, 99]
    async with running_app(app) as http:
        r = await http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(
            r.json()["data"][0]["embedding"], expected(runner, ids, pooling), rtol=1e-6, atol=1e-7
        )


async def test_bad_input_is_a_400_and_leaks_nothing(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner(max_model_len=64))
    async with running_app(app) as http:
        too_long = await http.post("/v1/embeddings", json={"input": list(range(100, 165))})
        err = error_of(too_long)
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        assert "maximum context length is 64 tokens" in err["message"] and "65 tokens" in err["message"]
        # The limit is the whole context: 64 tokens fit.
        assert (await http.post("/v1/embeddings", json={"input": list(range(100, 164))})).status_code == 200
        for empty in ("", [], [""], [[]], ["fine", ""]):
            err = error_of(await http.post("/v1/embeddings", json={"input": empty}))
            assert err["param"] == "input" and "empty" in err["message"], empty
        for bad in (
            {"input": "x", "encoding_format": "binary"},
            {"input": "x", "dimensions": 0},
            {},
            {"input": 3.5},
        ):
            assert error_of(await http.post("/v1/embeddings", json=bad))["type"] == "invalid_request_error"
        assert error_of(await http.post("/v1/embeddings", json={"input": [10**9]}))["param"] == "input"
        missing = await http.post("/v1/embeddings", json={"model": "other", "input": "x"})
        assert error_of(missing, 404)["code"] == "model_not_found"
        too_many = await http.post("/v1/embeddings", json={"input": ["a"] * 2049})
        assert "at most 2048" in error_of(too_many)["message"]
        await drained(app)


def app_with_pooling(tokenizer, runner: FakeRunner, files_say: ModelPooling, **config):
    """An app over a model whose files declare `files_say` (models.pooling)."""
    loaded = LoadedModel(runner, tokenizer, runner.vocab_size, files_say)
    return create_app(server_config(model=MODEL, log_stats_interval_s=0, **config), lambda: loaded)


async def test_a_model_that_cannot_embed(tokenizer) -> None:
    rank = ModelPooling(None, "gguf", "the GGUF file's pooling_type is 'rank': it is a reranker")
    async with running_app(app_with_pooling(tokenizer, FakeRunner(), rank)) as http:
        for path, body in (
            ("/v1/embeddings", {"input": "x"}),
            ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ):
            err = error_of(await http.post(path, json=body))
            assert (
                err["code"] == "model_cannot_embed"
                and "'rank'" in err["message"]
                and "--pooling" in err["message"]
            )
    # --pooling overrides what the files say.
    async with running_app(app_with_pooling(tokenizer, FakeRunner(), rank, pooling="mean")) as http:
        assert (await http.post("/v1/embeddings", json={"input": "x"})).status_code == 200


async def test_rerank_orders_documents_by_cosine_similarity(tokenizer) -> None:
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    query = "what is a cat"
    docs = ["a cat is an animal", "the stock market", "what is a cat", "cats and dogs"]
    q = expected(runner, tokenizer.encode(query))
    scores = [float(np.dot(q, expected(runner, tokenizer.encode(d)))) for d in docs]
    best = sorted(range(len(docs)), key=lambda i: -scores[i])
    async with running_app(app) as http:
        r = await http.post("/v1/rerank", json={"model": MODEL, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == MODEL and [x["index"] for x in body["results"]] == best
        assert best[0] == 2 and body["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-6)
        for x in body["results"]:
            assert x["relevance_score"] == pytest.approx(scores[x["index"]], abs=1e-6)
            assert x["document"] == {"text": docs[x["index"]]}
        tokens = sum(len(tokenizer.encode(t)) for t in [query, *docs])
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        # Cohere's v2 and Jina's paths, documents as objects, top_n, without the documents.
        for path in ("/rerank", "/v2/rerank"):
            r = await http.post(
                path,
                json={
                    "query": query,
                    "documents": [{"text": d} for d in docs],
                    "top_n": 2,
                    "return_documents": False,
                },
            )
            assert [x["index"] for x in r.json()["results"]] == best[:2]
            assert all("document" not in x for x in r.json()["results"])
        assert (
            error_of(await http.post("/v1/rerank", json={"query": "", "documents": docs}))["param"] == "query"
        )
        assert (
            error_of(await http.post("/v1/rerank", json={"query": "q", "documents": []}))["param"]
            == "documents"
        )
        assert error_of(await http.post("/v1/rerank", json={"query": "q", "documents": ["a"], "top_n": 0}))
        text = (await http.get("/metrics")).text
        for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
            assert metric(text, "orca:http_requests_total", route=route, method="POST", status="200") >= 1
        await drained(app)


async def test_requests_are_counted_per_route(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner())
    async with running_app(app) as http:
        assert (await http.post("/v1/embeddings", json={"input": "x"})).status_code == 200
        assert (await http.post("/v1/embeddings", json={"input": ""})).status_code == 400
        text = (await http.get("/metrics")).text
    assert metric(text, "orca:http_requests_total", route="/v1/embeddings", method="POST", status="200") == 1
    assert metric(text, "orca:http_requests_total", route="/v1/embeddings", method="POST", status="400") == 1


async def test_a_client_that_leaves_frees_the_blocks(tokenizer) -> None:
    """The client leaves while its long embeddings run chunk by chunk: they are aborted (the rest of
    their chunks never run) and every KV block comes back."""
    runner = FakeRunner(gate=threading.Event())
    app = make_app(tokenizer, runner, max_num_batched_tokens=32, max_num_seqs=4)
    inputs = [[100 + (i * 7 + j) % 900 for j in range(300)] for i in range(3)]
    async with live_server(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            asking = asyncio.create_task(http.post("/v1/embeddings", json={"input": inputs}))
            await asyncio.wait_for(asyncio.to_thread(runner.step_started.wait, 20), 20)
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking

        async def answered_499() -> bool:
            async with httpx.AsyncClient(base_url=url) as probe:
                text = (await probe.get("/metrics")).text
            return (
                "499" in text
                and metric(text, "orca:http_requests_total", route="/v1/embeddings", status="499") == 1
            )

        await wait_until(answered_499)
        runner.gate.set()
        await drained(app)
    chunks = sum(1 for step in runner.history for r in step if r.request_id.startswith("embd"))
    assert chunks < 900 // 32  # aborted long before every chunk ran


async def test_embeddings_batch_with_a_generation(tokenizer) -> None:
    """An embedding sent while a completion decodes runs in the same iteration loop and gives the vector
    it gives alone."""
    runner = FakeRunner()
    app = make_app(tokenizer, runner)
    ids = [101, 7, 99, 3000, 12, 55]
    async with running_app(app) as http:
        alone = (await http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"})).json()
        # The completion's steps are held at the gate until the embedding waits beside it, so the two share
        # a step however slowly this machine serves the second request.
        runner.gate.clear()
        completion = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "ignore_eos": True})
        )
        await wait_until(lambda: app.state.server.loop.stats().running == 1)
        embedding = asyncio.create_task(
            http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"})
        )
        await wait_until(lambda: (stats := app.state.server.loop.stats()).running + stats.waiting == 2)
        runner.gate.set()
        beside = (await embedding).json()
        assert (await completion).status_code == 200
        await drained(app)
    assert beside["data"] == alone["data"]
    assert any(len({r.request_id.split("-")[0] for r in step}) == 2 for step in runner.history)
