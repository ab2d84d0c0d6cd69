"""The OpenAI-compatible HTTP app: routes, exception handlers and the request guard.

    create_app(engine, tokenizer, served_model_name=...) -> FastAPI

Routes: GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
POST /v1/responses (OpenAI's Responses API, stateless: responses_api.py),
GET /health (liveness), GET /ready (engine ready, not draining), GET /metrics (Prometheus), and vLLM's
POST /tokenize, POST /detokenize, GET /version (utility_routes.py). A stopping frontend drains
(drain.py): /ready and new generation requests answer 503 while those in flight finish.
Every error, including FastAPI's own validation errors, is answered in OpenAI's error JSON.
Where the rest lives: the guard (guard.py) checks the key and the body's size; a body becomes
jobs (jobs.py), which run on the engine (generation.py) and are answered (serving.py) in each
endpoint's shape (shapers.py), streamed as server-sent events (sse.py).
The caller owns the engine's lifecycle (create_app never closes it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from inferencemesh.config import HTTP_BODY_TIMEOUT_S  # the whole body's deadline: then 408, connection closed
from inferencemesh.frontend.engine.api import Engine
from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.openai.drain import Drain, DrainGuard, draining_error
from inferencemesh.frontend.openai.errors import APIError, from_engine_error
from inferencemesh.frontend.openai.guard import RequestGuard
from inferencemesh.frontend.openai.jobs import engine_ready
from inferencemesh.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferencemesh.frontend.openai.response_bodies import (
    COMMON_ERRORS,
    GENERATION_ERRORS,
    ChatCompletion,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    openapi_document,
    streamed,
)
from inferencemesh.frontend.openai.responses_api import router as responses_router
from inferencemesh.frontend.openai.serving import Serving
from inferencemesh.frontend.openai.sse import SSE_KEEPALIVE_S
from inferencemesh.frontend.openai.utility_routes import router as utility_router

log = logging.getLogger("inferencemesh.frontend")

NOT_READY = {"model": ErrorResponse, "description": "The model is not ready yet, or this replica is draining"}

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


def create_app(engine: Engine, tokenizer: PreTrainedTokenizerBase, *, served_model_name: str,
               api_key: str | None = None, auth_exempt_paths: tuple[str, ...] = ("/health", "/ready", "/metrics"),
               max_body_bytes: int = 1024 * 1024, metrics: FrontendMetrics | None = None,
               body_timeout_s: float = HTTP_BODY_TIMEOUT_S, sse_keepalive_s: float = SSE_KEEPALIVE_S,
               drain: Drain | None = None) -> FastAPI:
    """The frontend's ASGI app. api_key None or "": no authentication. drain: the state a stopping
    server drains through (default: one of its own, app.state.drain)."""
    front = Serving(engine, tokenizer, served_model_name, metrics or FrontendMetrics(served_model_name),
                      sse_keepalive_s)
    drain = drain or Drain(front.metrics)
    app = FastAPI(title="InferenceMesh", description="OpenAI-compatible endpoint of an InferenceMesh.",
                  docs_url=None, redoc_url=None)
    app.state.frontend = front
    app.state.metrics = front.metrics
    app.state.drain = drain

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return front.error_response(exc)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return front.error_response(from_engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return front.error_response(invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):
            # Routing's own answer (a route's 404 says what was not found): name what was asked,
            # as OpenAI does, so a client's "model not found" guess is not the only clue.
            return front.error_response(APIError(
                exc.status_code, f"Invalid URL ({request.method} {request.url.path}): this server does not serve it",
                code="unknown_url"))
        return front.error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return front.error_response(APIError(500, "Internal server error.", type="server_error"))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health", responses=COMMON_ERRORS)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def not_ready() -> APIError | None:
        """The 503 while the model is not ready (a stage still loading, or lost), else None."""
        if await engine_ready(engine):
            return None
        return APIError(503, "The model is not ready yet.", type="service_unavailable", code="not_ready")

    @app.get("/ready", responses={503: NOT_READY, **COMMON_ERRORS})
    async def ready() -> Response:
        if drain.draining:  # the kubelet marks the pod unready: routers and endpoints stop sending to it
            return front.error_response(draining_error())
        refusal = await not_ready()
        return JSONResponse({"status": "ready"}) if refusal is None else front.error_response(refusal)

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                                    **COMMON_ERRORS})
    async def metrics_endpoint() -> Response:
        data, content_type = front.metrics.render()
        return Response(data, media_type=content_type)

    # The model is listed once it is ready, as /ready says (a draining replica still lists it, see
    # drain.py): clients take a listed model for a servable one, and the openai client retries a 503.
    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, 503: NOT_READY,
                                                           **COMMON_ERRORS})
    async def list_models() -> dict[str, Any]:
        refusal = await not_ready()
        if refusal is not None:
            raise refusal
        return {"object": "list", "data": [front.model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None,
             responses={200: {"model": ModelCard}, 404: GENERATION_ERRORS[404], 503: NOT_READY, **COMMON_ERRORS})
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != served_model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        refusal = await not_ready()
        if refusal is not None:
            raise refusal
        return front.model_card()

    @app.post("/v1/completions", responses={**streamed(CompletionResponse), **GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.handle(request, body)

    @app.post("/v1/chat/completions", responses={**streamed(ChatCompletion), **GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.handle(request, body)

    app.include_router(responses_router)  # POST /v1/responses (GET/DELETE: 404, nothing is stored)
    app.include_router(utility_router)  # vLLM's /tokenize, /detokenize, /version

    app.add_middleware(RequestGuard, api_key=api_key or None, exempt=tuple(auth_exempt_paths),
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, reject=front.error_response)
    app.add_middleware(DrainGuard, drain=drain, reject=front.error_response)  # outermost: counts every request
    return app
