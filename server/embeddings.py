"""/v1/embeddings and /v1/rerank: request bodies (pydantic), their inputs as token ids, the vectors made
from the loop's pooled hidden states (L2-normalised, cut to `dimensions`), and the response bodies.

OpenAI's embeddings API: `input` is a string, a list of strings, a list of token ids or a list of such
lists; `encoding_format` "float" (lists of numbers) or "base64" (each vector's little-endian float32
bytes, which the openai client decodes with numpy); `dimensions` keeps the first n values and
normalises them again (as OpenAI's text-embedding-3 and vLLM's Matryoshka models do). The rerank API
is Jina's and Cohere's (vLLM serves it too): a query, documents, `top_n`, `return_documents`; each
document is scored by the cosine similarity of its embedding with the query's (this server runs no
classification head: a cross-encoder reranker is not served).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field

from server.errors import invalid
from server.protocol import OpenAIModel

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def check_input_lengths(inputs: Sequence[Sequence[int]], max_model_len: int, param: str = "input") -> None:
    """Each input must fit the model's context whole (an embedding generates nothing after it)."""
    for i, ids in enumerate(inputs):
        if len(ids) > max_model_len:
            which = f"Input {i}" if len(inputs) > 1 else "The input"
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, {which.lower()} "
                f"has {len(ids)} tokens. Please reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and dimensions > hidden_size:
        raise invalid(
            f"dimensions must be at most {hidden_size}, this model's embedding size; got {dimensions}.",
            param="dimensions",
        )


def normalised(values: Sequence[float], dimensions: int | None = None) -> np.ndarray:
    """The pooled vector cut to its first `dimensions` values, L2-normalised (float32). A zero vector
    stays zero."""
    v = np.asarray(values, dtype=np.float64)[:dimensions]
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def embeddings_response(
    request_id: str,
    created: int,
    model: str,
    vectors: Sequence[np.ndarray],
    encoding_format: str,
    tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def document_text(document: str | RerankDocument) -> str:
    return document if isinstance(document, str) else document.text


def rerank_response(
    request_id: str,
    model: str,
    body: RerankRequest,
    query: np.ndarray,
    documents: Sequence[np.ndarray],
    tokens: int,
) -> dict[str, Any]:
    """Documents by cosine similarity with the query (both normalised), best first, the first top_n."""
    scores = [float(np.dot(query, d)) for d in documents]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": document_text(body.documents[i])}
        results.append(result)
    return {
        "id": request_id,
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
