"""The OpenAI-compatible HTTP app, assembled from its parts.

    create_app(engine, tokenizer, served_model_name=...) -> FastAPI

Routes, one folder or module per endpoint: POST /v1/chat/completions (chat/), POST
/v1/completions (completions/), POST /v1/responses (OpenAI's Responses API, stateless:
responses/), GET /health, /ready, /metrics and /v1/models[/{id}] (utility/service_routes.py),
and vLLM's POST /tokenize, POST /detokenize, GET /version (utility/routes.py). A stopping
frontend drains (drain.py): /ready and new generation requests answer 503 while those in flight
finish. Every error, including FastAPI's own validation errors, is answered in OpenAI's error
JSON (error_handlers.py).
Where the rest lives: the guard (guard.py) checks the key and the body's size; a body becomes
jobs (jobs.py), whose choices run on the engine (choices.py), their steps turned into text
pieces (text/), answered (serving.py) in each endpoint's shape (its shaper.py), streamed as
server-sent events (sse.py).
The caller owns the engine's lifecycle (create_app never closes it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from transformers import PreTrainedTokenizerBase

from inferencemesh.config import HTTP_BODY_TIMEOUT_S  # the whole body's deadline: then 408, connection closed
from inferencemesh.frontend.engine.api import Engine
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.openai.chat.routes import router as chat_router
from inferencemesh.frontend.openai.completions.routes import router as completions_router
from inferencemesh.frontend.openai.drain import Drain, DrainGuard
from inferencemesh.frontend.openai.error_handlers import install_error_handlers
from inferencemesh.frontend.openai.guard import RequestGuard
from inferencemesh.frontend.openai.response_bodies import openapi_document
from inferencemesh.frontend.openai.responses.routes import router as responses_router
from inferencemesh.frontend.openai.serving import Serving
from inferencemesh.frontend.openai.sse import SSE_KEEPALIVE_S
from inferencemesh.frontend.openai.utility.routes import router as utility_router
from inferencemesh.frontend.openai.utility.service_routes import router as service_router


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
    app.state.frontend = front  # the routes reach it through serving(request)
    app.state.metrics = front.metrics
    app.state.drain = drain
    install_error_handlers(app, front.error_response)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # in the order /openapi.json lists them
    for router in (service_router, completions_router, chat_router, responses_router, utility_router):
        app.include_router(router)

    app.add_middleware(RequestGuard, api_key=api_key or None, exempt=tuple(auth_exempt_paths),
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, reject=front.error_response)
    app.add_middleware(DrainGuard, drain=drain, reject=front.error_response)  # outermost: counts every request
    return app
