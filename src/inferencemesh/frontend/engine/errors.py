"""The engine's errors: each says the HTTP status and OpenAI error type it is answered with, so
that the HTTP layer maps them without knowing the engine's insides."""

from __future__ import annotations


class EngineError(Exception):
    """A request failed inside the engine; status and OpenAI error type for the HTTP layer."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None
    param: str | None = None  # the request parameter at fault, for a 400


class InvalidRequest(EngineError):
    """A request the engine cannot serve as asked (e.g. n beyond its concurrent sessions)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConstraintError(InvalidRequest):
    """A constraint the server refuses: a 400 naming the OpenAI parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)
        self.message = message


class EngineOverloaded(EngineError):
    """No room for the request: its queue is full, or it waited past the queue timeout."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "overloaded"


class ContextLengthExceeded(EngineError):
    """The prompt leaves no room in the model's context."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "context_length_exceeded"


class PipelineFailed(EngineError):
    """Generation failed in the stages (a stage lost past recovery, or a frame refused)."""

    status_code = 502
    error_type = "server_error"
    code = "pipeline_error"
