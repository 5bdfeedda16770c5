"""POST /v1/embeddings (OpenAI's API) and POST /v1/rerank, /rerank, /v2/rerank (Jina's and Cohere's
shape, as vLLM serves them): each input is an embedding request in the iteration loop (prefill only,
batched with generation: IterationLoop.embed), pooled as the model says (models/pooling.py) or as
--pooling overrides. Shapes and vectors: server/embeddings.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.contract import Pooling
from scheduler.loop import LoopStoppedError
from scheduler.outputs import RequestDelta
from server.embeddings import (
    EmbeddingInput,
    EmbeddingRequest,
    RerankRequest,
    check_dimensions,
    check_input_lengths,
    document_text,
    embeddings_response,
    normalised,
    rerank_response,
)
from server.errors import invalid
from server.generation import GenerationError, LoopClient
from server.responses import new_id
from server.routes.common import (
    ClientDisconnected,
    Deadline,
    admit,
    cancel_on_disconnect,
    check_token_ids,
    disconnected_response,
    loop_stopped_error,
    offload,
    ready_for,
)
from server.state import ServerState
from server.tokenizer import ServerTokenizer

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    method = pooling_of(state)
    check_dimensions(body.dimensions, loop.hidden_size)
    inputs = await input_token_ids(body.input, tokenizer, state, "input")
    check_input_lengths(inputs, loop.max_model_len)
    request_id = new_id("embd")
    pooled = await embed_all(request, state, loop, inputs, method, request_id)
    if pooled is None:
        return disconnected_response()
    vectors = [normalised(p, body.dimensions) for p in pooled]
    tokens = sum(len(ids) for ids in inputs)
    return JSONResponse(
        embeddings_response(
            request_id, int(time.time()), state.config.model_name, vectors, body.encoding_format, tokens
        )
    )


@router.post("/v1/rerank", response_model=None)
@router.post("/v2/rerank", response_model=None)
@router.post("/rerank", response_model=None)
async def rerank(body: RerankRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    method = pooling_of(state)
    if not body.query:
        raise invalid("'query' must not be empty.", param="query")
    texts = [document_text(d) for d in body.documents]
    if not texts:
        raise invalid("'documents' must not be empty.", param="documents")
    query = await input_token_ids([body.query], tokenizer, state, "query")
    documents = await input_token_ids(texts, tokenizer, state, "documents")
    check_input_lengths(query, loop.max_model_len, "query")
    check_input_lengths(documents, loop.max_model_len, "documents")
    request_id = new_id("rerank")
    pooled = await embed_all(request, state, loop, query + documents, method, request_id)
    if pooled is None:
        return disconnected_response()
    vectors = [normalised(p) for p in pooled]
    tokens = sum(len(ids) for ids in query + documents)
    return JSONResponse(
        rerank_response(request_id, state.config.model_name, body, vectors[0], vectors[1:], tokens)
    )


def pooling_of(state: ServerState) -> Pooling:
    """The pooling embeddings use; a 400 for a model whose files say it cannot embed."""
    pooling = state.pooling
    if pooling.method is None:
        raise invalid(
            f"This model cannot make embeddings: {pooling.problem}. Start the server with --pooling "
            "last|mean|cls to pool its final hidden states anyway.",
            param="model",
            code="model_cannot_embed",
        )
    return pooling.method


async def input_token_ids(
    given: EmbeddingInput, tokenizer: ServerTokenizer, state: ServerState, param: str
) -> list[list[int]]:
    """Every input as token ids: strings are tokenized with the tokenizer's special tokens (as
    sentence-transformers and vLLM do), token ids are taken as given. Empty inputs, too many and ids
    outside the vocabulary are 400s."""
    items: Sequence[str | int | list[int]] = [given] if isinstance(given, str) else given
    if not items:
        raise invalid(f"'{param}' must not be empty.", param=param)
    if all(isinstance(x, int) for x in items):
        items = [list(items)]  # type: ignore[arg-type]  # one input, as token ids
    limit = state.config.max_embedding_inputs
    if len(items) > limit:
        raise invalid(
            f"'{param}' may hold at most {limit} inputs on this server, got {len(items)}.", param=param
        )
    out: list[list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = await offload(tokenizer.encode, item, size=len(item)) if item else []
        else:
            ids = list(item)  # type: ignore[arg-type]
        if not ids:
            raise invalid(f"'{param}' holds an empty input (index {i}).", param=param)
        check_token_ids(ids, state.vocab_size, param)
        out.append(ids)
    return out


async def embed_all(
    request: Request,
    state: ServerState,
    loop: LoopClient,
    inputs: list[list[int]],
    method: Pooling,
    request_id: str,
) -> list[list[float]] | None:
    """Every input's pooled hidden states, in order, each an embedding request in the loop (admitted
    together: 429 on a full queue), under the request's deadline; None if the client left. However it
    ends, every one of its requests is aborted or finished: no KV block stays taken."""
    admit(state, loop, len(inputs))
    ids = [f"{request_id}-{i}" for i in range(len(inputs))]
    streams: list[AsyncIterator[RequestDelta]] = []
    try:
        for rid, tokens in zip(ids, inputs, strict=True):
            streams.append(loop.embed(tokens, method, rid))
    except ValueError as exc:
        _abort(loop, ids)
        raise invalid(str(exc), param="input") from None
    except LoopStoppedError as exc:
        _abort(loop, ids)
        raise loop_stopped_error(exc) from None

    async def one(stream: AsyncIterator[RequestDelta]) -> list[float]:
        last: RequestDelta | None = None
        async for delta in stream:
            last = delta
        if last is None or last.embedding is None:
            why = last.error if last is not None and last.error else "the request ended before it was pooled"
            raise GenerationError(f"The embedding failed: {why}")
        return last.embedding

    async def every() -> list[list[float]]:
        return list(await asyncio.gather(*(one(s) for s in streams)))

    deadline = Deadline(state, state.config.request_timeout_s)
    try:
        vectors = await cancel_on_disconnect(request, deadline.run(every()))
    except ClientDisconnected:
        _abort(loop, ids)
        return None
    except (GenerationError, LoopStoppedError) as exc:
        _abort(loop, ids)
        raise loop_stopped_error(exc) from None
    except BaseException:  # a timeout (408), a cancellation: none of its requests may stay queued
        _abort(loop, ids)
        raise
    return vectors


def _abort(loop: LoopClient, ids: list[str]) -> None:
    """Idempotent: finished requests are left alone by the loop."""
    for rid in ids:
        loop.abort(rid)
