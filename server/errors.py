"""OpenAI-shaped errors: one exception type for the routes, and handlers that turn every failure into
`{"error": {"message", "type", "param", "code"}}` with the right status (never a 422, never a bare 500
for bad input)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


@dataclass
class APIError(Exception):
    """An error to send back to the client as it stands."""

    message: str
    status_code: int = HTTPStatus.BAD_REQUEST
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = field(default=None, compare=False)  # e.g. Retry-After

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape, for the routes of its Messages API."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status_code, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer, in the shape of the API `path` belongs to (OpenAI's unless it is Anthropic's)."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


# Anthropic's Messages API: its routes answer errors in its shape, with its error types by status.
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, "invalid_request_error", param, code)


def not_ready() -> APIError:
    msg = "The model is still loading; retry when GET /health answers 200."
    return APIError(msg, HTTPStatus.SERVICE_UNAVAILABLE, "server_error", code="model_not_ready")


def queue_full(max_queue_len: int, retry_after_s: int) -> APIError:
    msg = (
        f"The server is busy: more than {max_queue_len} requests are waiting. Retry after {retry_after_s} s."
    )
    return _retry_later(
        msg, HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_error", "rate_limit_exceeded", retry_after_s
    )


def draining(retry_after_s: int) -> APIError:
    msg = "The server is shutting down and takes no new requests; retry on another replica."
    return _retry_later(
        msg, HTTPStatus.SERVICE_UNAVAILABLE, "server_error", "server_shutting_down", retry_after_s
    )


def _retry_later(msg: str, status: int, kind: str, code: str, retry_after_s: int) -> APIError:
    return APIError(msg, status, kind, code=code, headers={"Retry-After": str(retry_after_s)})


def request_timeout(timeout_s: float) -> APIError:
    msg = f"The request did not finish within the server's limit of {timeout_s:g} s."
    return APIError(msg, HTTPStatus.REQUEST_TIMEOUT, "timeout_error", code="request_timeout")


def lone_surrogate(path: str) -> APIError:
    """A body whose text at `path` is not Unicode (server/unicode_text.py)."""
    return invalid(
        f"`{path}` holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair), which is not "
        "Unicode text.",
        param=path,
        code="invalid_unicode",
    )


def body_timeout(timeout_s: float) -> APIError:
    msg = f"The request body did not arrive within the server's limit of {timeout_s:g} s."
    return APIError(msg, HTTPStatus.REQUEST_TIMEOUT, code="body_timeout")


def payload_too_large(limit: int) -> APIError:
    msg = f"The request body is larger than the server's limit of {limit} bytes."
    return APIError(msg, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, code="payload_too_large")


def unauthorized() -> APIError:
    msg = "Incorrect or missing API key. Send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)."
    return APIError(msg, HTTPStatus.UNAUTHORIZED, code="invalid_api_key")


def model_not_found(name: str) -> APIError:
    msg = f"The model `{name}` does not exist."
    return APIError(msg, HTTPStatus.NOT_FOUND, param="model", code="model_not_found")


def context_length_exceeded(max_len: int, prompt_tokens: int, completion_tokens: int) -> APIError:
    # OpenAI's wording, word for word, so clients that parse it keep working.
    return invalid(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, "
        f"{completion_tokens} in the completion). Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
    )


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages.0.content"; the body itself -> None."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # Pydantic names the union member it tried ("str", "list[int]", "function-after[...]"); the
    # client wants the field.
    parts = [p for p in parts if not (p.startswith(("list[", "function-", "dict[")) or p in ("str", "int"))]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return invalid("The request body is not valid JSON.", code="invalid_json")
    # For a union (prompt: str | list[...]) pydantic reports every member; the deepest location is the
    # member that got furthest, which names the actual fault.
    first = (
        max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"loc": (), "msg": "invalid request"}
    )
    param = _param_of(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return invalid("The request body must be a JSON object (send Content-Type: application/json).")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param and param.split(".")[0] == "prompt" and first.get("type") != "value_error":
        # The union's member-by-member complaints read badly; say what the field accepts.
        msg = (
            "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
        )
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{param}'." if param else "The request body is missing."
    elif param:
        message = f"Invalid value for '{param}': {msg}"
    else:
        message = f"Invalid request body: {msg}"
    return invalid(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(
            str(exc.detail), exc.status_code, kind, headers=getattr(exc, "headers", None)
        ).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = APIError(f"Internal server error: {type(exc).__name__}", 500, "server_error")
        return err.response(request.url.path)
