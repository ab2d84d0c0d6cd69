"""A Responses request as the ChatCompletionRequest that asks the same: `instructions` a leading
system message, `input` items the chat messages (function_call items an assistant turn's
tool_calls, function_call_output items tool messages), function `tools`, `tool_choice`,
`parallel_tool_calls`, `text.format` the response_format, `max_output_tokens` the
max_completion_tokens. That request runs exactly as /v1/chat/completions runs it (same prompt,
same sampling, same structured output); an error about it names the Responses parameter
(ChatTranslation.responses_param).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from inferencemesh.frontend.openai.chat.protocol import ChatCompletionRequest
from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.responses.protocol import CreateResponseRequest, FunctionToolParam, tool_strictness


@dataclass(frozen=True)
class ChatTranslation:
    """A Responses request's chat request, and where each of its chat messages came from."""

    chat: ChatCompletionRequest
    origins: list[str]  # each chat message's input item (input.N), or "instructions"

    def responses_param(self, param: str | None) -> str | None:
        """A chat request's parameter (an error's param) as the Responses request names it:
        messages.N the input item (or instructions) it came from, response_format text.format,
        max_completion_tokens max_output_tokens, tools.N.function.x tools.N.x."""
        if param is None:
            return None
        head, _, rest = param.partition(".")
        if head == "messages":
            index = rest.partition(".")[0]
            known = index.isdigit() and int(index) < len(self.origins)
            return self.origins[int(index)] if known else "input"
        if head in ("max_completion_tokens", "max_tokens"):
            return "max_output_tokens"
        if head == "response_format":
            rest = rest.removeprefix("json_schema").lstrip(".")
            return "text.format" + (f".{rest}" if rest else "")
        if head in ("tools", "tool_choice"):
            return param.replace(".function.", ".").replace(".function", "")
        return param


def to_chat(body: CreateResponseRequest) -> ChatTranslation:
    """The ChatCompletionRequest asking what body asks; APIError 400 naming the parameter for
    what cannot be asked."""
    refused = body.unsupported()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
    messages, origins = input_messages(body.input)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
        origins.insert(0, "instructions")
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    format_ = response_format(body)
    if format_ is not None:
        chat["response_format"] = format_
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("stream", "stream"), ("user", "user")):
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    try:  # as JSON, as an HTTP body is checked: the same strict rules
        return ChatTranslation(ChatCompletionRequest.model_validate_json(json.dumps(chat)), origins)
    except ValidationError as err:  # a shape the checks above let through: still a 400
        first = err.errors()[0]
        raise APIError(400, f"Invalid request: {first['msg']}", param=None) from err


def response_format(body: CreateResponseRequest) -> dict[str, Any] | None:
    """text.format as chat's response_format (None: free text)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        missing = "name" if fmt.name is None else "schema"
        raise APIError(400, f"text.format.{missing} is required for json_schema", param=f"text.format.{missing}")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


_MESSAGE_PARTS = {"input_text", "output_text"}  # the text parts; images, files, audio are refused
_ASSISTANT_PARTS = {"output_text", "input_text", "refusal"}  # an earlier response's message (a refusal: its text)
_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{param}.{key}", f"{param}.{key} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{param}.{key}", f"{param}.{key} must be valid Unicode text") from None
    return value


def _text_parts(content: Any, param: str, allowed: set[str]) -> str:
    """A message's content (a string or text parts) as its text."""
    if isinstance(content, str):
        return _string({"content": content}, "content", param.rsplit(".", 1)[0])
    if not isinstance(content, list):
        raise _bad(param, f"{param} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}.type", f"{where} must be a content part with a type")
        if part["type"] not in allowed:
            raise _bad(f"{where}.type", f"content parts of type {part['type']!r} are not supported here "
                                        f"(only {', '.join(sorted(allowed))}: this model reads text)")
        texts.append(_string(part, "refusal" if part["type"] == "refusal" else "text", where))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Responses' input as chat messages: a string is one user message; message items keep their
    role (developer as system's newer name stays developer: chat reads it as system);
    function_call items become an assistant turn's tool_calls (consecutive calls, and calls right
    after an assistant message, join that turn), function_call_output items tool messages.
    Also each message's origin, the input item it came from (input.N): an error about a chat
    message names the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    if not items:
        raise _bad("input", "input must hold at least one item")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_TYPES:
            raise _bad(f"{param}.type", f"input items of type {kind!r} are not supported (only "
                                        f"{', '.join(_ITEM_TYPES)}: nothing is stored, and this model reads text)")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{param}.role", f"{param}.role must be one of user, system, developer, assistant")
            messages.append({"role": role, "content": _text_parts(item.get("content"), f"{param}.content",
                                                                  _ASSISTANT_PARTS if role == "assistant"
                                                                  else _MESSAGE_PARTS)})
            origins.append(param)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(param)
        else:
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{param}.output", {"input_text"})
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
            origins.append(param)
    return messages, origins


def chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool in chat's nested form."""
    if tool.get("type") != "function":
        raise _bad(f"tools.{index}.type", f"tools of type {tool.get('type')!r} are not supported (only function tools: "
                                          "built-in tools such as web search run nowhere here)")
    try:
        checked = FunctionToolParam.model_validate_json(json.dumps(tool))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _bad(f"tools.{index}.{where}", f"tools.{index}.{where}: {first['msg']}") from err
    parameters, strict = tool_strictness(checked)
    function: dict[str, Any] = {"name": checked.name, "strict": strict}
    if checked.description is not None:
        function["description"] = checked.description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}
