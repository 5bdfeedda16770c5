"""loadtest.client: SSE parsing into timelines and error kinds, over httpx's mock transport."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from loadtest.client import Target, build_payload, send_request
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec

SPEC = RequestSpec(index=0, prompt=[1, 2, 3], prompt_len=3, output_len=3)


def sse(*events: object) -> bytes:
    lines = []
    for event in events:
        lines.append(event if isinstance(event, str) else f"data: {json.dumps(event)}\n\n")
    return "".join(lines).encode()


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {
        "id": "c",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }


async def send(handler, target: Target | None = None, spec: RequestSpec = SPEC) -> RequestRecord:
    target = target or Target("http://test", "m")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=target.base_url) as client:
        record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, scheduled_time=0.0)
        return await send_request(client, target, spec, record, time.perf_counter())


async def test_stream_becomes_a_timeline_with_the_usage_count():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        body = sse(
            ": keep-alive comment\n\n",
            text_chunk(" Hello"),
            text_chunk(""),  # a token whose text the server holds back (half a character): still a token
            text_chunk(" world"),
            text_chunk("", "length"),  # the closing chunk is not a token
            {
                "id": "c",
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            },
            "data: [DONE]\n\n",
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    record = await send(handler)
    assert record.ok and record.error is None
    assert len(record.token_times) == 3 and record.output_tokens == 3
    assert record.prompt_tokens_reported == 3
    assert record.send_time <= record.first_token_time == record.token_times[0] <= record.end_time
    assert seen["path"] == "/v1/completions"
    body = seen["body"]
    assert body["prompt"] == [1, 2, 3] and body["stream"] is True
    assert body["max_tokens"] == body["min_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_without_usage_the_token_chunks_are_counted():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(text_chunk("a"), text_chunk("b"), "data: [DONE]\n\n"))

    record = await send(handler)
    assert record.ok and record.output_tokens == 2 and record.prompt_tokens_reported is None


async def test_chat_payload_and_deltas():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["messages"] == [{"role": "user", "content": "hi there"}]
        assert body["max_completion_tokens"] == 3
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        ]
        return httpx.Response(200, content=sse(*chunks, "data: [DONE]\n\n"))

    spec = RequestSpec(0, "hi there", 2, 3)
    record = await send(handler, Target("http://test", "m", endpoint="chat"), spec)
    # The role-only first delta is no token: a server may send it before any token exists (this one
    # does, at admission), so counting it (vLLM's benchmark does) would measure no time to first token.
    assert record.ok and len(record.token_times) == 1
    with pytest.raises(ValueError):
        build_payload(Target("http://test", "m", endpoint="chat"), SPEC)  # chat needs text


def test_exact_lengths_unless_outputs_may_end_at_the_end_of_turn():
    """By default every output is exactly output_len tokens (min_tokens = max_tokens, EOS ignored);
    with ignore_eos off only max_tokens is sent, so an answer ends where the model ends it."""
    spec = RequestSpec(0, "hi", 2, 7)
    exact = build_payload(Target("http://test", "m"), spec)
    assert (exact["max_tokens"], exact["min_tokens"], exact["ignore_eos"]) == (7, 7, True)
    free = build_payload(Target("http://test", "m", ignore_eos=False), spec)
    assert free["max_tokens"] == 7 and "min_tokens" not in free and "ignore_eos" not in free


@pytest.mark.parametrize(
    ("respond", "kind"),
    [
        (lambda r: httpx.Response(503, json={"error": {"message": "busy"}}), "http_503"),
        (lambda r: httpx.Response(200, content=sse({"error": {"message": "engine died"}})), "stream"),
        (lambda r: httpx.Response(200, content=b"data: {not json\n\n"), "stream"),
        (lambda r: httpx.Response(200, content=sse("data: [DONE]\n\n")), "stream"),  # no token at all
    ],
)
async def test_failures_are_recorded_by_kind(respond, kind):
    record = await send(respond)
    assert not record.ok and record.error_kind == kind and record.error


@pytest.mark.parametrize(
    ("exc", "kind"), [(httpx.ConnectError("refused"), "connection"), (httpx.ReadTimeout("slow"), "timeout")]
)
async def test_transport_failures(exc, kind):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    record = await send(handler)
    assert record.error_kind == kind and record.end_time is None
