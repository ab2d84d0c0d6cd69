"""The body of POST /v1/responses (OpenAI's CreateResponse), checked strictly as the chat bodies
are (protocol.py): a known parameter we do not implement is a 400 naming it, an unknown one is
ignored; and the request's settings as a Response echoes them. to_chat.py turns it into the chat
request that asks the same; docs/responses-api.md lists every parameter as honoured or refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from inferencemesh.frontend.openai.protocol import Float, Int, RequestBody, StreamOptionsParam, Text
from inferencemesh.frontend.openai.tools import strict_if_possible

# Known parameters we do not implement: refused (400 naming them) whenever sent with a value.
REFUSED: dict[str, str] = {
    "previous_response_id": "responses are not stored here (a multi-replica mesh has no shared store): "
                            "send the whole conversation as input items",
    "conversation": "conversations are not stored here (a multi-replica mesh has no shared store): "
                    "send the whole conversation as input items",
    "prompt": "stored prompt templates are not supported",
    "reasoning": "this model does not reason",
    "include": "include is not supported (no logprobs, reasoning or tool outputs to include)",
    "context_management": "context_management is not supported",
    "moderation": "moderation is not supported",
}
# Known parameters whose only behaviour here is one fixed value: accepted when they ask for it.
FIXED: dict[str, object] = {
    "store": False,  # refused when true: see the module's docstring
    "background": False,
    "truncation": "disabled",  # a prompt too long for the context is a 400, never truncated
    "top_logprobs": 0,
}


class FunctionToolParam(RequestBody):
    """A function tool in Responses' flat form (chat nests the same fields under "function")."""

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # not given: strict where the schema can be (tool_strictness)


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None  # json_schema: required
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CreateResponseRequest(RequestBody):
    """The body of POST /v1/responses (OpenAI's CreateResponse), checked strictly."""

    model: Text
    input: Text | list[dict[str, Any]]  # items: checked one by one in to_chat.py, naming input.N...
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None  # checked in to_chat.py, naming tools.N...
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[Int, Field(ge=1)] | None = None  # built-in tools only: there are none here
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    stream: bool | None = None
    stream_options: StreamOptionsParam | None = None
    # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    # labels: accepted and echoed, they change nothing about the answer
    user: Text | None = None
    safety_identifier: Annotated[Text, Field(max_length=64)] | None = None
    prompt_cache_key: Text | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first requested feature we cannot honour, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            return "text.verbosity", "verbosity is not supported"
        for name, value in (self.model_extra or {}).items():
            if value is None or (name == "include" and value == []):
                continue
            if name in REFUSED:
                return name, REFUSED[name]
            if name in FIXED and value != FIXED[name]:
                return name, f"{name} must be {json.dumps(FIXED[name])} here" + (
                    ": responses are not stored (a multi-replica mesh has no shared store)"
                    if name in ("store", "background") else "")
        return None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response reports them (OpenAI echoes them with defaults)."""
        fmt: dict[str, Any] = {"type": "text"}
        if self.text is not None and self.text.format is not None:
            given = self.text.format
            fmt = {"type": given.type}
            if given.type == "json_schema":
                fmt.update(name=given.name, schema=given.schema_, strict=given.strict)
                if given.description is not None:
                    fmt["description"] = given.description
        echoed = {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": self.service_tier or "default",
            "store": False,
            "background": False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": tool_choice_echo(self.tool_choice),
            "tools": [echo_tool(FunctionToolParam.model_validate(t)) for t in self.tools or []],
            "top_logprobs": 0,
            "truncation": "disabled",
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
        }
        if self.user is None:  # the spec's user is a string, never null: absent when not sent
            del echoed["user"]
        return echoed


def tool_strictness(tool: FunctionToolParam) -> tuple[dict[str, Any] | None, bool]:
    """A function tool's parameters and whether it is strict. Responses' default is strict: a tool
    that does not say is made strict where its schema can be, else it is not (tools.strict_if_possible)."""
    if tool.strict is not None:
        return tool.parameters, tool.strict
    return strict_if_possible(tool.parameters)


def tool_choice_echo(choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    """tool_choice as a Response reports it (checked already by chat_tool_choice)."""
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    return {"type": "function", "name": choice["name"]}


def echo_tool(tool: FunctionToolParam) -> dict[str, Any]:
    parameters, strict = tool_strictness(tool)
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": parameters,
            "strict": strict}
