"""The OpenAI response bodies this server answers, as pydantic models: they document the served
/openapi.json (so schema-driven tools such as schemathesis check what the server really sends),
with the status codes it really answers (400, not FastAPI's 422).

The handlers build plain dicts (no per-response validation cost); tests check those dicts
against OpenAI's own spec and, through schemathesis, against these models.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache supplied (not computed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None  # None: a stream chunk before the last


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (text/event-stream, `data: ` lines)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text matching the function's parameters


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: the turn only calls tools
    refusal: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    inferencemesh: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# The errors every route can answer (the guard's 401 and 413, uvicorn's 503 over the connection
# limit) and those of the generation routes.
_ERROR = {"model": ErrorResponse}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {401: {**_ERROR, "description": "Invalid or missing API key"}}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **COMMON_ERRORS,
    400: {**_ERROR, "description": "Invalid request (the error names the parameter)"},
    404: {**_ERROR, "description": "The model does not exist"},
    408: {**_ERROR, "description": "The request body did not arrive in time"},
    413: {**_ERROR, "description": "The request body is too large"},
    429: {**_ERROR, "description": "Overloaded: retry after the Retry-After header's seconds"},
    500: {**_ERROR, "description": "Generation failed inside the server"},
    502: {**_ERROR, "description": "A pipeline stage failed"},
    503: {**_ERROR, "description": "The model is not ready yet, or this replica is draining (retry after the "
                                   "Retry-After header's seconds)"},
}


def streamed(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or with stream: true server-sent events of chunks."""
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}  # one SSE event
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


def openapi_document(app: Any) -> dict[str, Any]:
    """FastAPI's document, with its 422 (which this server never answers: a malformed body is
    OpenAI's 400) removed, and its HTTPValidationError schemas with it."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc
