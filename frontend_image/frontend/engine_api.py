"""The contract between the HTTP layer and the generation engine.

The HTTP layer (app.py) speaks OpenAI; the engine speaks token ids. Keeping the boundary
this small lets the same HTTP layer drive an in-process pipeline or a remote one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # end generation, not emitted


class EngineError(Exception):
    """A request failed inside the engine; status and OpenAI error type for the HTTP layer."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None


class EngineNotReady(EngineError):
    status_code = 503
    error_type = "service_unavailable"
    code = "not_ready"


class EngineOverloaded(EngineError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "overloaded"


class ContextLengthExceeded(EngineError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "context_length_exceeded"


class Engine(Protocol):
    model_name: str
    max_context: int

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        """Yield newly decided token ids (one or more per step) until max_tokens or a stop token.

        Closing the iterator early (aclose) cancels the request and releases its session.
        """
        ...

    async def is_ready(self) -> bool: ...

    def describe(self) -> dict:
        """Metadata for /v1/models: e.g. the resolved speculative strategy and why."""
        ...

    async def close(self) -> None: ...
