"""The FastAPI app factory: state, lifespan (background model loading), error handlers, routes."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.config import ServerConfig
from server.errors import install_error_handlers
from server.middleware import (
    PUBLIC_PATHS,
    APIKeyMiddleware,
    RequestBodyMiddleware,
    RequestIdMiddleware,
    RouteMetricsMiddleware,
)
from server.routes import chat, completions, embeddings, messages, misc, responses_api, webui
from server.state import ModelLoader, ServerState


def create_app(config: ServerConfig, loader: ModelLoader | None = None) -> FastAPI:
    """An app serving `config.engine.model`. `loader` builds the runner and tokenizer (in a worker thread);
    the default loads the real engine. The model loads during the lifespan's startup without
    blocking it, so the server answers (/health: 503) while the weights load."""
    if loader is None:
        from server.loader import load_served_model

        loader = functools.partial(load_served_model, config)
    state = ServerState(config, loader)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            await state.shutdown()

    app = FastAPI(title="orca-serve", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    # add_middleware puts each one outside the previous: the request id is outermost so that every
    # answer (401 and 413 included) carries it; CORS sits outside the key check so that a browser
    # can read a 401; the key check comes before the body is read.
    app.add_middleware(RequestBodyMiddleware, limit=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(
        APIKeyMiddleware,
        keys=config.all_api_keys,
        public_paths=PUBLIC_PATHS | webui.PAGES if config.webui else PUBLIC_PATHS,
        public_prefixes=(webui.ASSETS_PREFIX,) if config.webui else (),
    )
    if config.allowed_origins is not None:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id", "X-Api-Key", "Anthropic-Version"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RouteMetricsMiddleware, count=state.metrics.count_http)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(misc.public)
    app.include_router(misc.router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses_api.router)
    app.include_router(messages.router)
    app.include_router(embeddings.router)
    if config.webui:
        webui.mount(app)
    return app
