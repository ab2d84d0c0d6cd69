"""The one error type of the HTTP layer: whatever goes wrong is answered in OpenAI's format."""

from __future__ import annotations

import logging
from typing import Any

from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.openai_errors import error_body

log = logging.getLogger("inferencemesh.frontend")


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 - OpenAI's word
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, for a Retry-After header (a temporary refusal)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)


def _printable(text: str) -> str:
    """text with any lone surrogate replaced by U+FFFD: an error may quote what a client sent
    (a field name, a dict key), and a response body must still encode as UTF-8."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def from_engine_error(exc: EngineError) -> APIError:
    """The engine's error as the HTTP layer answers it (its status, type, code and parameter)."""
    return APIError(exc.status_code, str(exc) or type(exc).__name__, type=exc.error_type, code=exc.code,
                    param=exc.param)


def as_api_error(exc: Exception) -> APIError:
    """Any failure during generation, as an OpenAI error (unexpected ones are logged, not described)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    log.error("generation failed", exc_info=exc)
    return APIError(500, "Generation failed inside the server.", type="server_error")


LOGGED_MESSAGE_CHARS = 300  # an error's message in the log: enough to say why, never a body's worth


def log_server_error(err: APIError, request_id: str | None = None) -> None:
    """Every error answered leaves a line in the log: a 5xx a warning (an operator must see what
    failed), a 4xx at INFO with its parameter and reason (why a client's request was refused,
    without the client at hand). The message is quoted (repr) and cut: it may quote the request."""
    message = err.message if len(err.message) <= LOGGED_MESSAGE_CHARS else err.message[:LOGGED_MESSAGE_CHARS] + "..."
    log.log(logging.WARNING if err.status >= 500 else logging.INFO, "answered %d %s%s%s: %r", err.status,
            err.code or err.type, f" to {request_id}" if request_id else "",
            f" (param {err.param})" if err.param else "", message)
