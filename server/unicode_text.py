"""Request bodies whose text is not Unicode. JSON may spell a UTF-16 surrogate as a `\\uD800`-`\\uDFFF`
escape; a pair of them is one character, but a lone one decodes to a Python str that no UTF-8 codec
(the tokenizer's, the response's) accepts, and that failed deep inside a route as a 500. The body
is checked once, as it arrives, so every API answers it alike: a 400 that names the field."""

from __future__ import annotations

import json
import re
from typing import Any

# A surrogate's escape, the only way one gets into a JSON text (raw surrogate bytes are not UTF-8 and
# fail the JSON parser already). Bodies without one, nearly all of them, are not parsed here.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_at(body: bytes) -> str | None:
    """Where the JSON `body` holds a string (a key or a value) with a lone surrogate, as a path such as
    `messages[0].content`; None where it holds none, or is no JSON (the route's parser says so)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return _find(doc, "")


def _find(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return None if _is_text(value) else path or "body"
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _find(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if not _is_text(key):
                return path or "body"
            found = _find(item, where)
            if found is not None:
                return found
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
