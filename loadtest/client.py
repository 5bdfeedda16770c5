"""One streamed OpenAI request, recorded as a timeline (`RequestRecord`).

Every SSE chunk that carries a choice without finishing is a token event (vLLM counts chunks the same
way); the token count itself comes from the final usage chunk (`stream_options.include_usage`) when
the server sends one, since a chunk may hold several tokens or none (text held back mid-character).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.records import ErrorKind, RequestRecord
from loadtest.workload import RequestSpec


@dataclass(frozen=True)
class Target:
    """Where and how requests go."""

    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1 prefix is added here)
    model: str
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    request_timeout: float = 600.0  # seconds for a whole request
    # Exact output lengths: min_tokens = max_tokens and ignore_eos (vLLM's extensions), so every server
    # generates as many tokens. False: each output ends at the model's end of turn, as a client's does.
    ignore_eos: bool = True

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def build_payload(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """The request body. `ignore_eos` and `min_tokens` (vLLM extensions) make the output length exact
    where the target asks for it (Target.ignore_eos)."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body.update(min_tokens=spec.output_len, ignore_eos=True)
    if target.endpoint == "chat":
        if spec.messages is not None:
            body["messages"] = list(spec.messages)
        elif isinstance(spec.prompt, str):
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            raise ValueError("the chat endpoint takes text prompts")
        body["max_completion_tokens"] = spec.output_len  # the current name; max_tokens is the old one
    else:
        body["prompt"] = spec.prompt
    return body


class StreamError(Exception):
    """A 200 response whose stream could not be read as OpenAI chunks, or that carried an error."""


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str | None:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content")
    return choice.get("text")


def _announces_role(choice: dict[str, Any], endpoint: str) -> bool:
    delta = choice.get("delta") or {}
    return endpoint == "chat" and "role" in delta and not delta.get("content") and not delta.get("tool_calls")


def _handle_event(
    data: str, record: RequestRecord, endpoint: str, now: float, text_sink: list[str] | None = None
) -> None:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as exc:
        raise StreamError(f"not JSON: {data[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise StreamError(f"not a JSON object: {data[:200]!r}")
    if "error" in chunk:
        raise StreamError(f"server error in stream: {chunk['error']}")
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens_reported = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens_reported = int(details["cached_tokens"])
    for choice in chunk.get("choices") or []:
        text = _chunk_text(choice, endpoint)
        if text and text_sink is not None:
            text_sink.append(text)
        # A closing chunk (finish_reason set, no text) comes after the last token, and a chat stream's
        # opening chunk (the role, no text) before the first: neither is a token event. A chunk with no
        # text otherwise is one (a token whose text is held back, e.g. part of a character).
        if text or (choice.get("finish_reason") is None and not _announces_role(choice, endpoint)):
            if record.first_token_time is None:
                record.first_token_time = now
            record.token_times.append(now)


async def _stream(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    record: RequestRecord,
    t0: float,
    text_sink: list[str] | None,
) -> None:
    body = build_payload(target, spec)
    record.send_time = time.perf_counter() - t0
    async with client.stream("POST", target.path, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:500]
            record.error_kind = ErrorKind.http_error(resp.status_code)
            record.error = detail
            return
        usage_seen = False
        async for line in resp.aiter_lines():
            now = time.perf_counter() - t0
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event/id fields
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            _handle_event(data, record, target.endpoint, now, text_sink)
            usage_seen = usage_seen or record.output_tokens > 0
        record.end_time = time.perf_counter() - t0
    if record.first_token_time is None:
        raise StreamError("the stream ended without a token")
    if not usage_seen:
        record.output_tokens = len(record.token_times)


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    record: RequestRecord,
    t0: float,
    text_sink: list[str] | None = None,
) -> RequestRecord:
    """Send one request and fill `record` (times relative to `t0`, a perf_counter reading); the
    generated text goes to `text_sink` when given (a conversation resends it).

    Never raises for a failed request: the failure is recorded (error kind and message) so a run
    goes on and the summary counts it.
    """
    try:
        await asyncio.wait_for(
            _stream(client, target, spec, record, t0, text_sink), timeout=target.request_timeout
        )
    except (TimeoutError, httpx.TimeoutException) as exc:
        record.error_kind, record.error = ErrorKind.TIMEOUT, repr(exc)
    except httpx.TransportError as exc:  # connect refused, reset, incomplete chunked read
        record.error_kind, record.error = ErrorKind.CONNECTION, repr(exc)
    except StreamError as exc:
        record.error_kind, record.error = ErrorKind.STREAM, str(exc)
    if record.error_kind is not None:
        record.end_time = None
    return record
