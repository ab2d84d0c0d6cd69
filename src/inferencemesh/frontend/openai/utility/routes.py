"""vLLM's utility endpoints, in vLLM's request and response shapes:

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                   or {model?, messages, add_generation_prompt=true, continue_final_message=false,
                       add_special_tokens=false, return_token_strs=false}
                   -> {count, max_model_len, tokens[, token_strs]}
    POST /detokenize  {model?, tokens} -> {prompt}
    GET  /version     -> {version}

(GET /health, /ready, /metrics and /v1/models: service_routes.py.) Prompts are tokenised by
the same code as generation (prompts.py), so /tokenize counts exactly the tokens a request with
that prompt would send. Errors are APIErrors, answered in OpenAI's format by the app's handlers.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.prompts import chat_ids, text_ids
from inferencemesh.frontend.openai.response_bodies import GENERATION_ERRORS
from inferencemesh.frontend.openai.serving import Serving, serving
from inferencemesh.frontend.openai.tools import tool_calling_from_request
from inferencemesh.frontend.openai.utility.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UtilityRequest,
)

_ERRORS: dict[int | str, dict[str, Any]] = {code: GENERATION_ERRORS[code] for code in (400, 401, 404, 413)}

router = APIRouter()


def _parse(model: type[UtilityRequest], body: dict[str, Any]) -> Any:
    """Validate like FastAPI would, so a bad field is the same OpenAI 400 naming the parameter."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None
    refused = parsed.refused()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
    return parsed


def _frontend(request: Request, model: str | None) -> Serving:
    front = serving(request)
    if model is not None and model != front.model:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{front.model}`.",
                       param="model", code="model_not_found")
    return front


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    chat = "messages" in body
    parsed = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    front = _frontend(request, parsed.model)
    if chat:
        # The tools as a chat request with them renders them (tool_choice auto): the same count.
        calling = await asyncio.to_thread(tool_calling_from_request, parsed.tools, None, None)
        ids = await asyncio.to_thread(  # off the event loop: prompts can be long
            chat_ids, front.tokenizer, parsed.template_messages(), add_generation_prompt=parsed.add_generation_prompt,
            continue_final_message=parsed.continue_final_message, add_special_tokens=parsed.add_special_tokens,
            tools=calling.template_tools() if calling else None)
    else:
        ids = await asyncio.to_thread(text_ids, front.tokenizer, parsed.prompt,
                                      add_special_tokens=parsed.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": front.engine.max_context, "tokens": ids}
    if parsed.return_token_strs:
        out["token_strs"] = front.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, str]:
    parsed = _parse(DetokenizeRequest, body)
    front = _frontend(request, parsed.model)
    bad = next((t for t in parsed.tokens if not 0 <= t < front.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is outside the vocabulary (size {front.vocab_size}).", param="tokens")
    return {"prompt": str(front.tokenizer.decode(parsed.tokens))}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": metadata.version("inferencemesh")}
