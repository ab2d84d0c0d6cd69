"""The app's exception handlers: every error, FastAPI's own validation and routing errors
included, is answered in OpenAI's error JSON (errors.py's APIError), through one answer function
(Serving.error_response: it counts and logs each)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.openai.errors import APIError, from_engine_error

log = logging.getLogger("inferencemesh.frontend")

# pydantic names the branch of a union in an error's location ("function-after[...]", "list[...]",
# "str"): not a field a client can find in its request.
_UNION_BRANCH = re.compile(r"[\w-]+\[.*\]|str|int|float|bool|list|dict|none")


def invalid_body(errors: Sequence[Any]) -> APIError:
    """FastAPI's validation errors as OpenAI's 400 invalid_request_error (not FastAPI's 422),
    naming the field. A value that fits no branch of a union fails every branch: a branch whose
    type matched ("must be a finite number") says more than the others ("should be a string")."""
    def path(error: Any) -> str:
        return ".".join(str(p) for p in error["loc"][1:] if not (isinstance(p, str) and _UNION_BRANCH.fullmatch(p)))

    ranked = sorted(errors, key=lambda e: str(e["type"]).endswith("_type"))  # stable: type mismatches last
    details = list(dict.fromkeys(f"{path(e) or 'body'}: {e['msg']}" for e in ranked))
    param = path(ranked[0]) if ranked and ranked[0]["type"] != "json_invalid" else None
    return APIError(400, f"Invalid request body: {'; '.join(details[:5])}", param=param or None)


def install_error_handlers(app: FastAPI, answer: Callable[[APIError], JSONResponse]) -> None:
    """app's handlers of every error, each answered by answer(APIError)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return answer(from_engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):
            # Routing's own answer (a route's 404 says what was not found): name what was asked,
            # as OpenAI does, so a client's "model not found" guess is not the only clue.
            return answer(APIError(
                exc.status_code, f"Invalid URL ({request.method} {request.url.path}): this server does not serve it",
                code="unknown_url"))
        return answer(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return answer(APIError(500, "Internal server error.", type="server_error"))
