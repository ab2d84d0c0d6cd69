"""OpenAI's Responses API (POST /v1/responses) on top of the chat engine path.

A Responses request is checked (strictly, as openai_models.py checks chat bodies: a known
parameter we do not implement is a 400 naming it, an unknown one is ignored) and converted into
the ChatCompletionRequest that asks the same thing: `instructions` a leading system message,
`input` items the chat messages (function_call items an assistant turn's tool_calls,
function_call_output items tool messages), function `tools`, `tool_choice`,
`parallel_tool_calls`, `text.format` the response_format, `max_output_tokens` the
max_completion_tokens. That request runs exactly as /v1/chat/completions runs it (same prompt,
same sampling, same structured output), and ResponsesShaper lays the generated pieces out as a
Response object or its stream of typed events.

No store. A mesh may run several frontends behind a router, and they share no storage: a
response stored by one replica would be missing (or, worse, stale) on the next. So nothing is
stored: `store: true`, `previous_response_id`, `conversation`, `background: true` (and the
stored `prompt` templates) are refused with a 400 naming the parameter, every response says
`"store": false`, and GET/DELETE /v1/responses/{id} answer a 404 saying responses are not
stored. A client keeps its conversation itself and sends it whole as `input` items (the
function_call / function_call_output items of a tool loop included). docs/responses-api.md
lists every parameter as honoured or refused.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.openai.errors import APIError, as_api_error
from inferencemesh.frontend.openai.generation import Piece, Run, ToolCallDelta
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.protocol import ChatCompletionRequest, Float, Int, Text
from inferencemesh.frontend.openai.response_bodies import COMMON_ERRORS, GENERATION_ERRORS, ErrorResponse, streamed
from inferencemesh.frontend.openai.shapers import Shaper
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


class _Body(BaseModel):
    # extra="allow": known fields we refuse arrive in model_extra, where unsupported() sees them;
    # fields nobody has defined yet are ignored, so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionToolParam(_Body):
    """A function tool in Responses' flat form (chat nests the same fields under "function")."""

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # not given: strict where the schema can be (tool_strictness)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None  # json_schema: required
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptionsParam(_Body):
    include_obfuscation: bool | None = None  # accepted; events never carry obfuscation padding


class CreateResponseRequest(_Body):
    """The body of POST /v1/responses (OpenAI's CreateResponse), checked strictly."""

    model: Text
    input: Text | list[dict[str, Any]]  # items: checked one by one in chat_request(), naming input.N...
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None  # checked in chat_request(), naming tools.N...
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
    _origins: list[str] = PrivateAttr(default_factory=list)  # chat_request(): each chat message's input item

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

    # --- the chat request that asks the same ---

    def chat_request(self) -> ChatCompletionRequest:
        """The ChatCompletionRequest asking what this request asks; APIError 400 naming the
        parameter for what cannot be asked."""
        refused = self.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
        messages, origins = input_messages(self.input)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
            origins.insert(0, "instructions")
        self._origins = origins
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            chat["tools"] = [chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        response_format = self.response_format()
        if response_format is not None:
            chat["response_format"] = response_format
        for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("stream", "stream"), ("user", "user")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        try:  # as JSON, as an HTTP body is checked: the same strict rules
            return ChatCompletionRequest.model_validate_json(json.dumps(chat))
        except ValidationError as err:  # a shape the checks above let through: still a 400
            first = err.errors()[0]
            raise APIError(400, f"Invalid request: {first['msg']}", param=None) from err

    def responses_param(self, param: str | None) -> str | None:
        """A chat request's parameter (an error's param, after chat_request()) as this request
        names it: messages.N the input item (or instructions) it came from, response_format
        text.format, max_completion_tokens max_output_tokens, tools.N.function.x tools.N.x."""
        if param is None:
            return None
        head, _, rest = param.partition(".")
        if head == "messages":
            index = rest.partition(".")[0]
            known = index.isdigit() and int(index) < len(self._origins)
            return self._origins[int(index)] if known else "input"
        if head in ("max_completion_tokens", "max_tokens"):
            return "max_output_tokens"
        if head == "response_format":
            rest = rest.removeprefix("json_schema").lstrip(".")
            return "text.format" + (f".{rest}" if rest else "")
        if head in ("tools", "tool_choice"):
            return param.replace(".function.", ".").replace(".function", "")
        return param

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
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

    # --- what a Response echoes of its request ---

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


# --- input items -> chat messages -------------------------------------------------------------

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


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


# --- the answer: a Response, or its events ---------------------------------------------------------


def _response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


class OutputItems:
    """One choice's output items as its pieces arrive: a message item for text, a function_call
    item per tool call; the events that announce each step (Responses' stream) are returned, the
    items kept (the final Response's output). Items follow one another: a new one closes the open one."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's index -> its item

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        events = self.text(piece.text) if piece.text else []
        for call in piece.tool_calls:
            events += self.tool_call(call)
        return events

    def text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events = self.close("completed") + self._open_message()
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        return events + [_event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        events = self._add(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [_event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, part=copy.deepcopy(part))]

    def tool_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self.calls.get(call.index)
        if item is None:
            events = self.close("completed")
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call.id or f"call_{uuid.uuid4().hex}", "name": call.name or "", "arguments": ""}
            self.calls[call.index] = item
            events += self._add(item)
        if call.arguments:
            item["arguments"] += call.arguments
            events.append(_event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self.items.index(item), delta=call.arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [_event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (status: completed, or incomplete when the output was cut short)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        events: list[dict[str, Any]]
        if item["type"] == "message":
            part = item["content"][0]
            events = [_event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=part["text"], logprobs=[]),
                      _event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=copy.deepcopy(part))]
        else:
            events = [_event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])]
        return events + [_event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        """The end of the choice: an answer with no output at all is an empty message."""
        events = [] if self.items else self._open_message()
        return events + self.close("incomplete" if finish_reason == "length" else "completed")


# response.failed's error.code (an enum of OpenAI's) for an error's type; others: server_error
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


class ResponsesShaper(Shaper):
    """Responses' layout of the chat engine path's pieces: a Response object, or its typed events
    (`event: <type>` + `data: <json>`, numbered by sequence_number, no [DONE]). The request's
    settings a Response echoes are registered per response id (expect/forget) by the route."""

    response_object = chunk_object = "response"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: dict[str, dict[str, Any]] = {}  # response id -> its echoed settings

    def expect(self, response_id: str, echo: dict[str, Any]) -> None:
        self.requests[response_id] = echo

    def forget(self, response_id: str) -> None:
        self.requests.pop(response_id, None)

    def _response(self, job: Job, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "id": job.id, "object": "response", "created_at": job.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": self._incomplete(job) if status == "incomplete" else None,
            "model": job.model, "output": copy.deepcopy(output),
            **self.requests.get(job.id, {}),
        }
        if usage is not None:  # the spec's usage is never null: absent until the response is done
            body["usage"] = _response_usage(usage)
        return body

    def _incomplete(self, job: Job) -> dict[str, Any]:
        """Why an output was cut: max_output_tokens when that limit was reached. Otherwise the
        context window filled first, which none of the spec's reasons (max_output_tokens,
        content_filter) says: the details then give no reason rather than a wrong one."""
        limit = self.requests.get(job.id, {}).get("max_output_tokens")
        return {"reason": "max_output_tokens"} if limit is not None and job.completion_tokens >= limit else {}

    @staticmethod
    def _status(job: Job) -> str:
        return "incomplete" if job.finish_reason == "length" else "completed"

    # --- a whole response ---

    def choice(self, run: Run, pieces: list[Piece]) -> dict[str, Any]:
        output = OutputItems()
        for piece in pieces:
            output.feed(piece)
        output.finish(run.job.finish_reason)
        return {"output": output.items}

    def response(self, job: Job, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return self._response(job, self._status(job), choices[0]["output"], usage)

    # --- a stream ---

    def _state(self, job: Job) -> dict[str, Any]:
        if "output" not in job.shape_state:
            job.shape_state.update(sequence=0, output=OutputItems())
        return job.shape_state

    def chunk(self, job: Job, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
        """The events of one step, numbered in the order they are sent."""
        state = self._state(job)
        out = []
        for event in (choice or {}).get("events", []):
            event["sequence_number"] = state["sequence"]
            state["sequence"] += 1
            data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
            out.append(f"event: {event['type']}\ndata: {data}\n\n")
        return "".join(out)

    def opening(self, run: Run) -> list[dict[str, Any]]:
        snapshot = self._response(run.job, "in_progress", [], None)
        return [{"events": [_event("response.created", response=snapshot),
                            _event("response.in_progress", response=copy.deepcopy(snapshot))]}]

    def delta(self, job: Job, piece: Piece) -> dict[str, Any]:
        return {"events": self._state(job)["output"].feed(piece)}

    def closing(self, job: Job) -> dict[str, Any]:
        return {"events": self._state(job)["output"].finish(job.finish_reason)}

    def stream_end(self, job: Job, usage: dict[str, Any]) -> list[str]:
        status = self._status(job)
        response = self._response(job, status, self._state(job)["output"].items, usage)
        return [self.chunk(job, {"events": [_event(f"response.{status}", response=response)]})]

    def stream_error(self, job: Job, error: dict[str, Any]) -> list[str]:
        """An `error` event (OpenAI's error fields), then `response.failed` carrying the response."""
        body = error.get("error", {})
        code = FAILED_CODES.get(body.get("type", ""), "server_error")
        failed = self._response(job, "failed", self._state(job)["output"].items, None,
                                error={"code": code, "message": body.get("message", "")})
        return [self.chunk(job, {"events": [
            _event("error", code=body.get("code") or body.get("type"), message=body.get("message", ""),
                   param=body.get("param")),
            _event("response.failed", response=failed)]})]

    def logprobs(self, job: Job, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        return None  # never asked for: top_logprobs and include are refused


# --- the routes ----------------------------------------------------------------------------------


class ResponseObject(BaseModel):
    """Documents /v1/responses' 200 (the full shape is OpenAI's Response; tests check it against the spec)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]


class _Forgetting:
    """A stream's body that forgets the response's echoed settings once the stream is closed
    (always: EventStream closes its body), whether or not it ever started."""

    def __init__(self, body: AsyncIterable[Any], forget: Callable[[], None]) -> None:
        self.body: AsyncIterator[Any] = aiter(body)
        self.forget = forget

    def __aiter__(self) -> _Forgetting:
        return self

    async def __anext__(self) -> Any:
        return await anext(self.body)

    async def aclose(self) -> None:
        try:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self.forget()


NOT_STORED: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "Responses are not stored by this server"}}
router = APIRouter()


@router.post("/v1/responses", responses={**streamed(ResponseObject), **GENERATION_ERRORS})
async def create_response(body: CreateResponseRequest, request: Request) -> Response:
    front = request.app.state.frontend
    chat = body.chat_request()
    shaper = front.shapers["response"]
    assert isinstance(shaper, ResponsesShaper)
    response_id = f"resp_{uuid.uuid4().hex}"
    shaper.expect(response_id, body.echo())
    try:
        answer: Response = await front.handle(request, chat, shape="response", request_id=response_id)
    except (APIError, EngineError) as exc:  # checked as a chat request: name the parameter as this request has it
        shaper.forget(response_id)
        err = as_api_error(exc)
        err.param = body.responses_param(err.param)
        raise err from exc
    except BaseException:
        shaper.forget(response_id)
        raise
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = _Forgetting(answer.body_iterator, lambda: shaper.forget(response_id))
    else:
        shaper.forget(response_id)
    return answer


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
