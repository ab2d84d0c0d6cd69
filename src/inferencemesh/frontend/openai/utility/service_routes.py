"""The routes about the server itself: GET /health (liveness), GET /ready (the engine ready and
this replica not draining), GET /metrics (Prometheus), GET /kv/events (what its KV cache holds,
for the router: protocol/kv_events.py), GET /kv/tokenizer[/{file}] (its tokenizer's files, for a
router that cannot read the model folder: it tokenizes prompts as this frontend does) and
GET /v1/models[/{id}] (the model it serves, listed once it is ready).

/kv/events and /kv/tokenizer are authenticated as the API is (a block's digest of a known prompt
tells whether that prompt was sent): the router presents the same key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

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

# The files a tokenizer is loaded from (transformers' names): never weights, never code.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt")
TOKENIZER_MAX_BYTES = 128 * 1024 * 1024  # all of them together (a large vocabulary's tokenizer.json: ~30 MB)
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


def tokenizer_files(front: Serving) -> tuple[Path, dict[str, int]]:
    """The folder this frontend's tokenizer was loaded from, and its tokenizer files' sizes (404 when
    it was not loaded from a folder, 413 when they exceed TOKENIZER_MAX_BYTES together)."""
    folder = Path(str(getattr(front.tokenizer, "name_or_path", "") or ""))
    if not str(folder) or not folder.is_dir():
        raise APIError(404, "This frontend's tokenizer was not loaded from a folder.", code="not_found")
    files = {name: (folder / name).stat().st_size for name in TOKENIZER_FILES if (folder / name).is_file()}
    if sum(files.values()) > TOKENIZER_MAX_BYTES:
        raise APIError(413, f"This frontend's tokenizer files exceed {TOKENIZER_MAX_BYTES} bytes.",
                       code="tokenizer_too_large")
    return folder, files


@router.get("/kv/tokenizer", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}},
                                        404: GENERATION_ERRORS[404], **COMMON_ERRORS})
async def tokenizer_listing(request: Request) -> dict[str, Any]:
    """The tokenizer's files (name -> bytes) and its source, as /kv/events names it."""
    front = serving(request)
    folder, files = tokenizer_files(front)
    return {"tokenizer": str(folder), "files": files}


@router.get("/kv/tokenizer/{name}", responses={200: {"content": {"application/octet-stream": {}}},
                                               404: GENERATION_ERRORS[404], **COMMON_ERRORS})
async def tokenizer_file(name: str, request: Request) -> Response:
    """One of the tokenizer's files, as it is on disk (only the names /kv/tokenizer lists)."""
    folder, files = tokenizer_files(serving(request))
    if name not in files:
        raise APIError(404, f"No tokenizer file `{name}` here.", code="not_found")
    return FileResponse(folder / name, media_type="application/octet-stream")


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
