"""Pure ASGI middleware, outermost first: a request id for every log line, API-key checks, and the
request body's checks (its size, its arrival, its text). Pure ASGI (not BaseHTTPMiddleware) so SSE
streams and disconnect messages pass through untouched."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, body_timeout, lone_surrogate, payload_too_large, unauthorized
from server.unicode_text import lone_surrogate_at

# The id of the request being handled in this task ("-" outside a request); RequestIdFilter puts it
# in every log record, and generation tasks inherit it (asyncio copies the context into new tasks).
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("orca_request_id", default="-")

# A client's own X-Request-Id is echoed when it looks like an id; anything else (log injection,
# megabyte headers) is replaced by a fresh one.
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

access_logger = logging.getLogger("server.access")

# Routes that probes and scrapers call without a key.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record, so a format can say `[%(request_id)s]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


async def _send_error(scope: Scope, send: Send, err: APIError) -> None:
    # The app below never runs, so the answer is sent here (the request body is never read).
    await err.response(scope.get("path", ""))(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class RequestIdMiddleware:
    """Sets the request id for the request's logs, returns it as X-Request-Id, and writes the access
    log line (uvicorn's own access log runs outside the request and cannot carry the id). Streams are
    logged when they end, with their full duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = _header(scope, b"x-request-id")
        rid = client_id if client_id and _CLIENT_ID_RE.match(client_id) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        status = 0
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if scope["path"] not in PUBLIC_PATHS or status >= 400:  # probes and scrapes stay quiet
                client = scope.get("client")
                access_logger.info(
                    "%s %s %s %d %.1fms",
                    client[0] if client else "-",
                    scope["method"],
                    scope["path"],
                    status,
                    (time.perf_counter() - start) * 1000,
                )
            request_id_var.reset(token)


class RouteMetricsMiddleware:
    """Counts every HTTP answer by route, method and status (`count`: ServerMetrics.count_http). The
    route is the path template of the route that matched (FastAPI leaves it in the scope), so
    /v1/responses/{response_id} is one series whatever the id."""

    def __init__(self, app: ASGIApp, count: Callable[[str, str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status = status or 500  # answered by Starlette's error middleware, outside this one
            raise
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            # No answer and no error: the client left before one was sent (nginx's 499).
            self.count(template, scope["method"], status or 499)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but PUBLIC_PATHS (and CORS preflights, which
    browsers send without credentials), or `x-api-key: <key>` as Anthropic's clients send it. Keys are
    compared as SHA-256 digests with hmac.compare_digest, against every key without stopping at a
    match, so neither the length nor the position of a key shows in the timing."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Iterable[str],
        public_paths: frozenset[str] = PUBLIC_PATHS,
        public_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        # The web UI's pages and static files are public: they hold no data, and ask for the key.
        self._public_paths = public_paths
        self._public_prefixes = public_prefixes

    def accepts(self, authorization: str | None, api_key: str | None = None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        bearer = self._matches(token.strip()) and scheme.lower() == "bearer"
        return self._matches((api_key or "").strip()) | bearer  # both compared, whichever was sent

    def _matches(self, token: str) -> bool:
        digest = hashlib.sha256(token.encode()).digest()
        matched = False
        for key in self._digests:
            matched |= hmac.compare_digest(digest, key)
        return matched and bool(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self._digests
            or scope["path"] in self._public_paths
            or scope["path"].startswith(self._public_prefixes)
            or scope["method"] == "OPTIONS"
            or self.accepts(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
        ):
            await self.app(scope, receive, send)
            return
        await _send_error(scope, send, unauthorized())


class RequestBodyMiddleware:
    """The request body, buffered (at most `limit` bytes) and checked before the app sees it: 413 for a
    body over `limit` bytes, at once from Content-Length or as soon as a chunked body passes the limit;
    408 for a body that has not arrived whole `timeout_s` after its headers (a client sending a byte a
    second would otherwise hold its connection and buffer for as long as it likes); 400 for a body
    whose text is not Unicode (server/unicode_text.py). The body is replayed to the app; later
    messages (http.disconnect, which the routes watch for) come from the real receive."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _send_error(scope, send, payload_too_large(self.limit))
            return
        buffered: list[Message] = []
        size = 0
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            try:
                message = await _receive_by(receive, deadline)
            except asyncio.TimeoutError:
                assert self.timeout_s is not None
                access_logger.warning("request body not received within %g s; answered 408", self.timeout_s)
                await _send_error(scope, send, body_timeout(self.timeout_s))
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await _send_error(scope, send, payload_too_large(self.limit))
                return
            buffered.append(message)
            if not message.get("more_body", False):
                break
        where = lone_surrogate_at(b"".join(m.get("body", b"") for m in buffered))
        if where is not None:
            await _send_error(scope, send, lone_surrogate(where))
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


async def _receive_by(receive: Receive, deadline: float | None) -> Message:
    if deadline is None:
        return await receive()
    return await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))


def _header(scope: Scope, name: bytes) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
