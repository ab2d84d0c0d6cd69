"""OpenAI's error body, shaped in one place: `{"error": {"message", "type", "param", "code"}}`.

The frontend answers its errors in this shape (frontend/openai/errors.py) and the router answers
its own (router/app.py) and ends a broken SSE stream with it; the openai client raises on it.
"""

from __future__ import annotations

import json
from typing import Any


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; every field present (`param` and `code` null when unset)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """The error object as a JSON response body."""
    return json.dumps(error_body(message, type_, param=param, code=code)).encode()


def sse_error_event(message: str, type_: str, *, code: str | None = None) -> bytes:
    """The error object as one SSE event (`data: {...}` and its blank line), for a stream that cannot go on."""
    return b"data: " + error_json(message, type_, code=code) + b"\n\n"
