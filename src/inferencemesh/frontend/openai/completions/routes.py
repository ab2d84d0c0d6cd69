"""POST /v1/completions: a prompt's (or a batch of prompts') continuations, whole (JSON) or streamed (SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inferencemesh.frontend.openai.completions.protocol import CompletionRequest
from inferencemesh.frontend.openai.response_bodies import GENERATION_ERRORS, CompletionResponse, streamed
from inferencemesh.frontend.openai.serving import serving

router = APIRouter()


@router.post("/v1/completions", responses={**streamed(CompletionResponse), **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await serving(request).handle(request, body)
