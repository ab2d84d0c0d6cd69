"""POST /v1/responses (OpenAI's Responses API) on top of the chat path, and the routes of stored
responses, which answer 404.

The request becomes the chat request that asks the same (to_chat.py), runs as
/v1/chat/completions runs it, and is answered in Responses' shapes (shaper.py).

No store. A mesh may run several frontends behind a router, and they share no storage: a
response stored by one replica would be missing (or, worse, stale) on the next. So nothing is
stored: `store: true`, `previous_response_id`, `conversation`, `background: true` (and the
stored `prompt` templates) are refused with a 400 naming the parameter, every response says
`"store": false`, and GET/DELETE /v1/responses/{id} answer a 404 saying responses are not
stored. A client keeps its conversation itself and sends it whole as `input` items (the
function_call / function_call_output items of a tool loop included).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.openai.errors import APIError, as_api_error
from inferencemesh.frontend.openai.response_bodies import COMMON_ERRORS, GENERATION_ERRORS, ErrorResponse, streamed
from inferencemesh.frontend.openai.responses.protocol import CreateResponseRequest
from inferencemesh.frontend.openai.responses.to_chat import to_chat
from inferencemesh.frontend.openai.serving import serving


class ResponseObject(BaseModel):
    """Documents /v1/responses' 200 (the full shape is OpenAI's Response; tests check it against the spec)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]


NOT_STORED: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "Responses are not stored by this server"}}
router = APIRouter()


@router.post("/v1/responses", responses={**streamed(ResponseObject), **GENERATION_ERRORS})
async def create_response(body: CreateResponseRequest, request: Request) -> Response:
    translation = to_chat(body)
    try:
        return await serving(request).handle(request, translation.chat, shape="response",
                                             request_id=f"resp_{uuid.uuid4().hex}", echoed=body.echo())
    except (APIError, EngineError) as exc:  # checked as a chat request: name the parameter as this request has it
        err = as_api_error(exc)
        err.param = translation.responses_param(err.param)
        raise err from exc


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found: this server does not store responses "
                         "(store is always false), so none can be retrieved, listed or deleted.",
                    param="response_id", code="response_not_found")


@router.get("/v1/responses/{response_id:path}", responses={**NOT_STORED, **COMMON_ERRORS})
async def get_response(response_id: str) -> Response:
    raise _not_stored(response_id)


@router.delete("/v1/responses/{response_id:path}", responses={**NOT_STORED, **COMMON_ERRORS})
async def delete_response(response_id: str) -> Response:
    raise _not_stored(response_id)


@router.post("/v1/responses/{response_id}/cancel", responses={**NOT_STORED, **COMMON_ERRORS})
async def cancel_response(response_id: str) -> Response:
    raise _not_stored(response_id)  # only background responses can be cancelled: there are none
