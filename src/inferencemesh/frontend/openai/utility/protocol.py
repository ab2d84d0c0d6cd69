"""The bodies of vLLM's utility endpoints (POST /tokenize, POST /detokenize), strict like the
generation bodies; fields nobody has defined are ignored (newer clients work)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from inferencemesh.frontend.openai.chat.protocol import ChatCompletionRequest, ChatMessage
from inferencemesh.frontend.openai.protocol import REFUSED, Int, RequestBody, Text


class UtilityRequest(RequestBody):
    model: Text | None = None

    def refused(self) -> tuple[str, str] | None:
        """A known vLLM field we do not implement, sent with a value."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name in REFUSED:
                return name, REFUSED[name]
        return None


class TokenizeCompletionRequest(UtilityRequest):
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(UtilityRequest):
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


class DetokenizeRequest(UtilityRequest):
    tokens: list[Int]
