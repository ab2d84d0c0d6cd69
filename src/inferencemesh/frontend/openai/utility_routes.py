"""vLLM's utility endpoints, in vLLM's request and response shapes:

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                   or {model?, messages, add_generation_prompt=true, continue_final_message=false,
                       add_special_tokens=false, return_token_strs=false}
                   -> {count, max_model_len, tokens[, token_strs]}
    POST /detokenize  {model?, tokens} -> {prompt}
    GET  /version     -> {version}

(GET /health is the app's.) Prompts are tokenised by the same code as generation (prompts.py),
so /tokenize counts exactly the tokens a request with that prompt would send. The handlers
reach the frontend through `request.app.state.frontend` (create_app sets it); errors are
APIErrors, answered in OpenAI's format by the app's handlers.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.prompts import chat_ids, text_ids
from inferencemesh.frontend.openai.protocol import REFUSED, ChatCompletionRequest, ChatMessage, Int, Text
from inferencemesh.frontend.openai.response_bodies import GENERATION_ERRORS
from inferencemesh.frontend.openai.tools import tool_calling_from_request

_ERRORS: dict[int | str, dict[str, Any]] = {code: GENERATION_ERRORS[code] for code in (400, 401, 404, 413)}

router = APIRouter()


class _Utility(BaseModel):
    # Strict like the generation bodies; fields nobody has defined are ignored (newer clients work).
    model_config = ConfigDict(strict=True, extra="allow")

    model: Text | None = None

    def refused(self) -> tuple[str, str] | None:
        """A known vLLM field we do not implement, sent with a value."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name in REFUSED:
                return name, REFUSED[name]
        return None


class TokenizeCompletionRequest(_Utility):
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Utility):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template places BOS and control tokens
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true"
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return "continue_final_message", "continue_final_message needs a final assistant message"
        return super().refused()

    def template_messages(self) -> list[dict[str, Any]]:
        # The chat endpoint's own mapping of messages to the template's (one decision, one place).
        return ChatCompletionRequest.model_construct(messages=self.messages).template_messages()


class DetokenizeRequest(_Utility):
    tokens: list[Int]


def _parse(model: type[_Utility], body: dict[str, Any]) -> Any:
    """Validate like FastAPI would, so a bad field is the same OpenAI 400 naming the parameter."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None
    refused = parsed.refused()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
    return parsed


def _frontend(request: Request, model: str | None) -> Any:
    front = request.app.state.frontend
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
    return {"prompt": front.tokenizer.decode(parsed.tokens)}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": metadata.version("inferencemesh")}
