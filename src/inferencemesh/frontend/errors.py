"""The one error type of the HTTP layer: whatever goes wrong is answered in OpenAI's format."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 - OpenAI's word
                 param: str | None = None, code: str | None = None) -> None:
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    """text with any lone surrogate replaced by U+FFFD: an error may quote what a client sent
    (a field name, a dict key), and a response body must still encode as UTF-8."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
