"""The body of POST /v1/chat/completions: its messages and their tool calls."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from inferencemesh.frontend.openai.protocol import MAX_LOGPROBS, Int, RequestBody, SamplingRequest, Text


class TextContentPart(RequestBody):
    type: Literal["text"]
    text: Text


class MessageFunction(RequestBody):
    """The function an assistant turn's tool call called, as a client sends it back."""

    name: Text
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(RequestBody):
    """A tool call an assistant turn made (what a client sends back with the tool's result)."""

    id: Text
    type: Literal["function"]
    function: MessageFunction


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant turn (OpenAI's schema: one that carried tool calls): it reads as ""
    content: Text | Annotated[list[TextContentPart], Field(min_length=1)] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "content is required unless the role is assistant")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message carries tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "a tool message needs the tool_call_id it answers")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: "developer" is OpenAI's newer name for "system"
        (templates only know the latter); a call's arguments as an object when they are JSON
        (templates render them with tojson, as transformers and vLLM pass them), else as given."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None  # vLLM: only false
    # Function calling (tools.py checks them: a bad one is its 400, naming the field)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens == 0 or self.max_completion_tokens == 0:
            return "max_tokens", "max_tokens must be at least 1"
        if self.echo:
            return "echo", "echo is not supported for chat"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; it wins when both are set.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it."""
        return [m.template_message() for m in self.messages]

    def tool_fields(self) -> dict[str, Any]:
        """The function-calling fields, as tools.tool_calling_from_request takes them."""
        return {"tools": self.tools, "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls}


def _arguments(text: str) -> Any:
    """A history's call arguments as the template renders them: parsed when they are JSON (templates
    write them with tojson), else the string as given. OpenAI accepts any string there, and a
    client sends back what the model wrote, a call cut short by the length limit included."""
    try:
        arguments = json.loads(text)
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")  # an escaped lone surrogate cannot be rendered
    except (ValueError, RecursionError):  # UnicodeEncodeError included
        return text
    return arguments
