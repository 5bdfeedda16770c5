"""GET /health, /metrics, /v1/models; POST /tokenize, /detokenize (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from server.errors import APIError, draining, not_ready
from server.metrics import CONTENT_TYPE
from server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from server.routes.chat_job import render_prompt
from server.routes.common import check_model, check_token_ids, get_state, offload
from server.state import ServerState

public = APIRouter()  # no API key needed (server.middleware.PUBLIC_PATHS)
router = APIRouter()


@public.get("/health", response_model=None)
async def health(request: Request) -> Response:
    state = get_state(request)
    if state.ready:
        return JSONResponse({"status": "ok", "kv_cache": state.kv_cache_capacity})
    if state.draining:  # load balancers take this replica out while in-flight requests finish
        return draining(state.config.retry_after_s).response()
    if state.loop is not None and state.loop.is_restarting:  # back in seconds; requests queue meanwhile
        return APIError(
            "The engine's workers are restarting.",
            503,
            "server_error",
            None,
            "engine_restarting",
            {"Retry-After": str(state.config.retry_after_s)},
        ).response()
    if state.load_error is not None:
        err = APIError(
            f"Loading the model failed: {state.load_error}", 503, "server_error", None, "model_load_failed"
        )
        return err.response()
    if state.loop is not None:  # loaded once, and the loop has stopped since
        return APIError("The engine is not running.", 503, "server_error", None, "engine_dead").response()
    return not_ready().response()


@public.get("/metrics", response_model=None)
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state: ServerState) -> dict[str, Any]:
    loop, _ = state.require_ready()
    return {
        "id": state.config.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "orca-serve",
        "root": state.config.engine.model,
        "parent": None,
        "max_model_len": loop.max_model_len,
    }


@router.get("/v1/models", response_model=None)
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(get_state(request))]})


@router.get("/v1/models/{model_id:path}", response_model=None)
async def retrieve_model(model_id: str, request: Request) -> Response:
    state = get_state(request)
    card = _model_card(state)
    check_model(state, model_id)
    return JSONResponse(card)


def _parse(model: type, payload: Any) -> Any:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


@router.post("/tokenize", response_model=None)
async def tokenize(request: Request, payload: dict[str, Any] = Body(...)) -> Response:
    """{prompt, add_special_tokens} or {messages, add_generation_prompt} -> {count, max_model_len, tokens}."""
    state = get_state(request)
    loop, tokenizer = state.require_ready()
    if "messages" in payload:
        chat = _parse(TokenizeChatRequest, payload)
        check_model(state, chat.model)
        _, ids = await render_prompt(
            tokenizer, chat.messages, chat.add_generation_prompt, kwargs=chat.chat_template_kwargs
        )
    else:
        plain = _parse(TokenizeCompletionRequest, payload)
        check_model(state, plain.model)
        ids = await offload(tokenizer.encode, plain.prompt, plain.add_special_tokens, size=len(plain.prompt))
    return JSONResponse(
        {"count": len(ids), "max_model_len": loop.max_model_len, "tokens": ids, "token_strs": None}
    )


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    _, tokenizer = state.require_ready()
    check_model(state, body.model)
    check_token_ids(body.tokens, state.vocab_size, "tokens")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})
