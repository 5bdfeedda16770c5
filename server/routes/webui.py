"""The browser pages: the chat page at `/`, the live iteration view at `/live`, their static files under
`/webui/`, and the live view's event stream at `/live/events`.

The pages and their files are public (they hold no data; with --api-key set the page asks for a key
and sends it on its own calls). The event stream is behind the key like every API route: the page
reads it with fetch() and a stream reader, so the key travels in the Authorization header. EventSource
cannot send headers, and a key in the query string would land in access logs, browser history and
proxies, so the stream takes no key there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, Response
from sse_starlette import EventSourceResponse
from starlette.staticfiles import StaticFiles

from server.routes.common import get_state

WEBUI_DIR = Path(__file__).resolve().parent.parent / "webui"
ASSETS_PREFIX = "/webui/"
PAGES = frozenset({"/", "/live"})

# The model's text is rendered by the page's own code into DOM text nodes, never parsed as HTML; this
# policy is the second wall: no script, style or connection from anywhere but this server, no inline
# script, no plugins, no framing.
_DOCUMENT_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new server version's page is picked up at once
}

public = APIRouter()  # no key: server.middleware lets PAGES and ASSETS_PREFIX through
router = APIRouter()


def _page(name: str) -> Response:
    return FileResponse(WEBUI_DIR / name, media_type="text/html", headers=_DOCUMENT_HEADERS)


@public.get("/", include_in_schema=False)
async def chat_page() -> Response:
    return _page("index.html")


@public.get("/live", include_in_schema=False)
async def live_page() -> Response:
    return _page("live.html")


@router.get("/live/events", include_in_schema=False)
async def live_events(request: Request) -> Response:
    """SSE: a `hello` event with the engine's limits, then `steps` events (server.live_feed)."""
    state = get_state(request)
    feed = state.live_feed
    assert feed is not None  # the route is mounted only with the web UI on

    async def events() -> AsyncIterator[dict[str, str]]:
        cfg = state.config
        hello = {
            "model": cfg.model_name,
            "scheduling": cfg.scheduler.scheduling,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "interval_ms": round(feed.limits.interval_s * 1000),
            "ready": state.ready,
        }
        yield {"event": "hello", "data": json.dumps(hello)}
        async for message in feed.subscribe():
            yield {"event": "steps", "data": message}

    return EventSourceResponse(events(), ping=10, headers={"Cache-Control": "no-cache"})


def mount(app: FastAPI) -> None:
    app.include_router(public)
    app.include_router(router)
    app.mount(ASSETS_PREFIX.rstrip("/"), StaticFiles(directory=WEBUI_DIR), name="webui")
