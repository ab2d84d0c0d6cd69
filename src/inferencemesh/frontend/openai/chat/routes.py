"""POST /v1/chat/completions: a conversation's next assistant message, whole (JSON) or streamed (SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inferencemesh.frontend.openai.chat.protocol import ChatCompletionRequest
from inferencemesh.frontend.openai.response_bodies import GENERATION_ERRORS, ChatCompletion, streamed
from inferencemesh.frontend.openai.serving import serving

router = APIRouter()


@router.post("/v1/chat/completions", responses={**streamed(ChatCompletion), **GENERATION_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await serving(request).handle(request, body)
