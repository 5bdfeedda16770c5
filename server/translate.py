"""What the APIs that translate their requests into the chat path share: building the chat request, and
naming their own fields (not the chat request's) in the 400s it raises."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from server.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


def rename_param(param: str | None, names: Mapping[str, str]) -> str | None:
    """ "messages.3.content" -> "input" (the field the client sent), "max_tokens" -> "max_output_tokens"."""
    if param is None:
        return None
    head = param.split(".")[0]
    return names.get(head, param)


@contextlib.contextmanager
def client_params(names: Mapping[str, str]) -> Iterator[None]:
    """APIErrors raised inside name the client's fields."""
    try:
        yield
    except APIError as exc:
        exc.param = rename_param(exc.param, names)
        raise


def validated(model: type[M], fields: dict[str, Any], names: Mapping[str, str]) -> M:
    """`model` built from translated fields; what fails is a 400 naming the client's field."""
    with client_params(names):
        try:
            return model.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None
