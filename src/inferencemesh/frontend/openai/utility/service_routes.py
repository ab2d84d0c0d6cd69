"""The routes about the server itself: GET /health (liveness), GET /ready (the engine ready and
this replica not draining), GET /metrics (Prometheus), GET /kv/events (what its KV cache holds,
for the router: protocol/kv_events.py) and GET /v1/models[/{id}] (the model it serves, listed
once it is ready)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from inferencemesh.frontend.openai.drain import draining_error
from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.jobs import engine_ready
from inferencemesh.frontend.openai.response_bodies import (
    COMMON_ERRORS,
    GENERATION_ERRORS,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from inferencemesh.frontend.openai.serving import Serving, serving

NOT_READY = {"model": ErrorResponse, "description": "The model is not ready yet, or this replica is draining"}

router = APIRouter()


async def not_ready(front: Serving) -> APIError | None:
    """The 503 while the model is not ready (a stage still loading, or lost), else None."""
    if await engine_ready(front.engine):
        return None
    return APIError(503, "The model is not ready yet.", type="service_unavailable", code="not_ready")


@router.get("/health", responses=COMMON_ERRORS)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", responses={503: NOT_READY, **COMMON_ERRORS})
async def ready(request: Request) -> Response:
    front = serving(request)
    if request.app.state.drain.draining:  # the kubelet marks the pod unready: routers and endpoints stop sending to it
        return front.error_response(draining_error())
    refusal = await not_ready(front)
    return JSONResponse({"status": "ready"}) if refusal is None else front.error_response(refusal)


@router.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **COMMON_ERRORS})
async def metrics_endpoint(request: Request) -> Response:
    data, content_type = serving(request).metrics.render()
    return Response(data, media_type=content_type)


@router.get("/kv/events", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}},
                                     400: GENERATION_ERRORS[400], 404: GENERATION_ERRORS[404], **COMMON_ERRORS})
async def kv_events(request: Request, after: int | None = Query(None, description="the last sequence number seen"),
                    epoch: str | None = Query(None, description="the epoch it was seen in")) -> Response:
    """The KV blocks this frontend's cache stored and removed after `after` (a snapshot of every
    block held when `after` or `epoch` is not one it can answer from its log)."""
    front = serving(request)
    blocks = getattr(front.engine, "blocks", None)  # a PipelineEngine's block manager
    if blocks is None:
        raise APIError(404, "This frontend publishes no KV events.", code="not_found")
    page = blocks.event_page(after, epoch, tokenizer=str(getattr(front.tokenizer, "name_or_path", "") or ""))
    return JSONResponse(page.to_json())  # as it is: a snapshot's thousands of digests skip FastAPI's encoder


# The model is listed once it is ready, as /ready says (a draining replica still lists it, see
# drain.py): clients take a listed model for a servable one, and the openai client retries a 503.
@router.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, 503: NOT_READY, **COMMON_ERRORS})
async def list_models(request: Request) -> dict[str, Any]:
    front = serving(request)
    refusal = await not_ready(front)
    if refusal is not None:
        raise refusal
    return {"object": "list", "data": [front.model_card()]}


@router.get("/v1/models/{model_id:path}", response_model=None,
            responses={200: {"model": ModelCard}, 404: GENERATION_ERRORS[404], 503: NOT_READY, **COMMON_ERRORS})
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    front = serving(request)
    if model_id != front.model:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    refusal = await not_ready(front)
    if refusal is not None:
        raise refusal
    return front.model_card()
