"""Bad input, tried systematically: hypothesis generates request bodies from the app's own
/openapi.json (a small JSON-schema -> strategy translation below), then breaks them (wrong types, NaN and huge numbers, unknown
fields, dropped fields, bodies that are not objects, bytes that are not JSON or UTF-8) and sends them to
every POST route of the fake-runner app in process. Every answer must be below 500, an error must be
in OpenAI's shape, a stream must end with [DONE], and no request may hang.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from typing import Any

import httpx
import pytest
from fakes import FakeRunner, fake_loader, parse_sse, running_app, server_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_until

from server.app import create_app
from server.tokenizer import ServerTokenizer

NUM_EXAMPLES = 600
HANG_GUARD_S = 30.0  # not a timing assertion: a request still open after this is a hang
MODEL = "fake-model"

# Values that break validators in practice: NaN and infinities (Python's json accepts them), huge and
# negative integers, wrong types, empty and odd strings.
NASTY = st.sampled_from(
    [
        math.nan,
        math.inf,
        -math.inf,
        -1,
        0,
        10**18,
        -(10**18),
        2**63,
        1e308,
        "",
        "\x00",
        "\ud800"[:0] + "é" * 3,
        "NaN",
        True,
        None,
        [],
        {},
        [None],
        {"": None},
    ]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def body_schema(openapi: dict[str, Any], route: str) -> dict[str, Any]:
    return openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy the JSON-schema subset pydantic emits (types, bounds, enums, anyOf, refs,
    objects with required / optional properties). Lists and strings are kept short so 600 examples
    run fast; size limits have their own tests in test_hardening."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema.get("anyOf", schema.get("oneOf"))])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**31) - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**31 + 1) - 1)
        return st.integers(min_value=lo, max_value=hi)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind == "array":
        items = from_schema(schema.get("items", {}), components)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=max(schema.get("minItems", 0), 4))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, components) for k, v in props.items() if k in required},
            optional={k: from_schema(v, components) for k, v in props.items() if k not in required},
        )
    return JSON  # no constraint ({}: any JSON value)


@st.composite
def plausible(draw: st.DrawFn, valid: st.SearchStrategy[Any], route: str) -> Any:
    """A schema-generated generation request whose core fields are set to values that run, so the
    odd sampling values (top_k, penalties, seeds, logit_bias, stops, ...) reach the scheduler and the
    runner instead of stopping at validation."""
    body = dict(draw(valid))
    for key in ("model", "suffix", "best_of", "echo", "tools", "tool_choice", "response_format"):
        body.pop(key, None)
    body["n"] = draw(st.integers(1, 2))
    body["max_tokens"] = draw(st.integers(1, 8))
    body.pop("max_completion_tokens", None)
    body.pop("min_tokens", None)
    if not body.get("stream"):
        body.pop("stream_options", None)
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
        if body.get("top_logprobs") is not None:
            body["logprobs"] = True
    else:
        body["prompt"] = draw(st.sampled_from(["Hello", "Once upon a time", [520, 9531, 198]]))
    if draw(st.booleans()):  # random keys are rarely token ids: half the time, go without
        body.pop("logit_bias", None)
    return body


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    body = draw(valid)
    if not isinstance(body, dict) or not body:
        return body
    body = dict(body)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["nasty", "junk", "drop", "unknown"]))
        key = draw(st.sampled_from(sorted(body))) if body else "prompt"
        if action == "nasty":
            body[key] = draw(NASTY)
        elif action == "junk":
            body[key] = draw(JSON)
        elif action == "drop":
            body.pop(key, None)
        else:
            body[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
    return body


@pytest.fixture(scope="module", params=["fake", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def fuzz_app(request, smollm2_tokenizer_dir):
    """The app over ASGI on an event loop of its own (hypothesis drives a sync test); small limits
    keep every generated request cheap. `fake`: the fake runner (fast, in the default run);
    `tiny-llama`: the real LocalExecutor and sampler, which see every odd sampling value too."""
    limits = dict(max_n=4, max_choices=8, max_num_seqs=16, log_stats_interval_s=0, max_body_bytes=64 * 1024)
    if request.param == "fake":
        tokenizer = ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
        config = server_config(model=MODEL, **limits)
        loader = fake_loader(tokenizer, FakeRunner(max_model_len=64, num_kv_blocks=64))
    else:
        from server.loader import load_served_model

        tiny = request.getfixturevalue("tiny_llama_dir")
        config = server_config(
            model=str(tiny),
            served_model_name=MODEL,
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            max_model_len=64,
            **limits,
        )

        def loader():
            return load_served_model(config)

    app = create_app(config, loader)
    loop = asyncio.new_event_loop()
    ctx = running_app(app)
    client = loop.run_until_complete(ctx.__aenter__())
    openapi = loop.run_until_complete(client.get("/openapi.json")).json()
    yield loop, client, openapi, app
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    # sse-starlette leaves a shutdown watcher task per event loop; end it before closing the loop.
    loop.run_until_complete(_cancel_leftover_tasks())
    loop.close()


async def _cancel_leftover_tasks() -> None:
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)


# How each API's stream ends when it ran to its end: OpenAI's chat and completions with [DONE], the
# Responses API with its final lifecycle event, Anthropic's Messages API with message_stop.
STREAM_ENDS = {
    "/v1/responses": {"response.completed", "response.incomplete"},
    "/v1/messages": {"message_stop"},
}


def check_response(r: httpx.Response, stream: bool, route: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    anthropic = route.startswith("/v1/messages")
    if r.status_code >= 400:
        body = r.json()
        if anthropic:  # Anthropic's error shape on its routes
            assert set(body) == {"type", "error"} and body["type"] == "error"
            assert set(body["error"]) == {"type", "message"}
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    elif stream and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = parse_sse(r.text)
        ends = STREAM_ENDS.get(route)
        if ends is None:
            assert events and events[-1] == "[DONE]"
            events = events[:-1]
        else:
            assert events and events[-1]["type"] in ends, events[-1]
        for e in events:
            assert "error" not in e and e.get("type") != "error", e  # a request that passed validation runs
    else:
        json.loads(r.text)


def test_fuzz_openapi_routes(fuzz_app) -> None:
    loop, client, openapi, app = fuzz_app
    routes = sorted(
        p for p, ops in openapi["paths"].items() if "post" in ops and "requestBody" in ops["post"]
    )
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(routes)
    components = openapi.get("components", {}).get("schemas", {})
    valid = {route: from_schema(body_schema(openapi, route), components) for route in routes}
    statuses: Counter[int] = Counter()
    raw_bodies = st.binary(max_size=64) | st.sampled_from([b"\xff\xfe{}", b"{", b"[]", b"null", b'{"a":1'])

    async def send(route: str, content: bytes) -> httpx.Response:
        return await asyncio.wait_for(
            client.post(route, content=content, headers={"content-type": "application/json"}), HANG_GUARD_S
        )

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def one_request(data: st.DataObject) -> None:
        route = data.draw(st.sampled_from(routes))
        kinds = ["valid", "mutated", "mutated", "json", "bytes"]
        if route in ("/v1/completions", "/v1/chat/completions"):
            kinds += ["plausible", "plausible"]
        kind = data.draw(st.sampled_from(kinds))
        if kind == "bytes":
            content = data.draw(raw_bodies)
            stream = False
        else:
            strategy = {
                "valid": valid[route],
                "plausible": plausible(valid[route], route) if kind == "plausible" else valid[route],
                "mutated": mutated(valid[route]),
                "json": JSON,
            }[kind]
            body = data.draw(strategy)
            if kind == "valid" and isinstance(body, dict) and "model" in body:
                body["model"] = MODEL  # any other name is a (correct) 404: keep valid bodies valid
            stream = isinstance(body, dict) and body.get("stream") is True
            # allow_nan: NaN and Infinity go out as the bare tokens a careless client would send.
            content = json.dumps(body, allow_nan=True).encode()
        r = loop.run_until_complete(send(route, content))
        statuses[int(r.status_code)] += 1
        check_response(r, stream, route)

    one_request()
    total = sum(statuses.values())
    print(f"fuzz: {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert total >= 500
    assert statuses[200] > 0 and any(400 <= s < 500 for s in statuses)
    # Nothing leaked: every request's KV blocks and queue entries are gone once the loop settles.
    engine = app.state.server.loop

    def settled() -> bool:
        stats = engine.stats()
        return stats.running == stats.waiting == stats.kv_blocks_used == 0

    loop.run_until_complete(wait_until(settled))
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert engine.is_running
