"""Function calling: a request's tools checked, written into the prompt by the chat template,
and enforced by a grammar; text/tool_calls.py parses the calls back out of the output.

The call format is Hermes' (text/tool_calls.py shows it). The grammar (llguidance Lark)
decides what the model may write, by tool_choice:

    none       no grammar from the tools, and the tools stay out of the prompt: the answer is text
    auto       text (not starting with "<tool_call>"), or one or more calls
    required   one or more calls
    named      exactly one call, to that function (parallel_tool_calls does not apply)

Each call's arguments are its function's JSON schema (`%json`, strict or not: llguidance enforces
what the schema says either way; `strict` adds OpenAI's subset rules, checked here), so a call
always parses and matches its schema. An object that lists its properties and does not say
whether others are allowed is closed (closed_objects): arguments are a signature. With auto
and a response_format, the text is that format.
parallel_tool_calls false allows one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import llguidance

from inferencemesh.frontend.engine.constraints import (
    JSON_WHITESPACE_FLEXIBLE,
    Constraint,
    ConstraintKind,
    check_strict,
    json_schema_constraint,
    subschemas,
    validated_grammar,
)
from inferencemesh.frontend.engine.errors import ConstraintError
from inferencemesh.frontend.openai.text.tool_calls import (
    ARGUMENTS_KEY,
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    ToolCallParser,
)

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_BYTES = 256 * 1024  # every function's definition together, as compact JSON
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule
# Arguments as Python's json.dumps writes them (what chat templates render a history's calls with).
_ARGUMENTS_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without parameters takes none


class ToolChoice(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"  # a named function


@dataclass(frozen=True)
class Function:
    name: str
    parameters: str  # its JSON schema, canonical text (sorted keys, compact)
    strict: bool
    definition: str  # the tool as the request gave it (JSON text): what the chat template renders

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates take it: as the client wrote it (its keys in its order)."""
        entry: dict[str, Any] = json.loads(self.definition)
        return entry


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how it lets the model use them."""

    functions: tuple[Function, ...]
    choice: ToolChoice
    forced: str | None = None  # ToolChoice.FUNCTION: the function's name
    parallel: bool = True

    @property
    def may_call(self) -> bool:
        return self.choice is not ToolChoice.NONE

    def parser(self) -> ToolCallParser:
        """The parser of this request's output: with auto the output may be text, else only calls."""
        return ToolCallParser(text_allowed=self.choice is ToolChoice.AUTO)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template writes into the prompt (None with tool_choice none)."""
        return [f.template_entry() for f in self.functions] if self.may_call else None

    def constraint(self, text: Constraint | None) -> Constraint | None:
        """The output's constraint: calls (and, with auto, text in `text`'s format or free)."""
        if not self.may_call:
            return text
        if text is not None and text.kind not in (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA):
            raise ConstraintError(text.param, f"{text.kind.value} output cannot be combined with tools; "
                                              "use a JSON schema (response_format) or no tools")
        lark = self._lark(text)
        grammar = validated_grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools")
        spec = json.dumps({"lark": lark}, sort_keys=True)
        return Constraint(ConstraintKind.TOOL_CALLS, spec, grammar, "tools")

    def _lark(self, text: Constraint | None) -> str:
        callable_ = [f for f in self.functions if self.forced is None or f.name == self.forced]
        lines = [
            "start: " + ("calls" if self.choice is not ToolChoice.AUTO else "text | calls"),
            # a named function is called once; otherwise parallel_tool_calls allows more calls
            "calls: call" + (f" ({json.dumps(CALL_SEPARATOR)} call)*" if self.parallel and self.forced is None else ""),
            "call: " + " | ".join(f"call_{i}" for i in range(len(callable_))),
        ]
        if self.choice is ToolChoice.AUTO:
            if text is None:  # free text, but not a call's start: a call must parse as one
                lines += ["text: TEXT", "TEXT: /(?s:.+)/ & ~/<tool_call>(?s:.*)/"]
            else:
                schema = {**json.loads(text.spec), "x-guidance": {"whitespace_flexible": JSON_WHITESPACE_FLEXIBLE}}
                lines.append(f"text: %json {json.dumps(schema)}")
        for i, function in enumerate(callable_):
            head = f'{CALL_OPEN}{{"name": "{function.name}{ARGUMENTS_KEY}'
            lines.append(f"call_{i}: {json.dumps(head)} arguments_{i} {json.dumps(CALL_CLOSE)}")
            schema = {**closed_objects(json.loads(function.parameters)), "x-guidance": _ARGUMENTS_FORMAT}
            lines.append(f"arguments_{i}: %json {json.dumps(schema)}")
        return "\n".join(lines)


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """schema with every object that lists its properties closed (additionalProperties false) unless
    it says otherwise. A function's parameters are its signature: an argument it does not name
    would fail the call, and a small model left free to add some rambles on until max_tokens."""
    schema = json.loads(json.dumps(schema))  # a copy: the request's schema is reported as it was
    for _, sub in subschemas(schema, "#"):
        if "properties" in sub and "additionalProperties" not in sub:
            sub["additionalProperties"] = False
    return schema


def strict_if_possible(parameters: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """A function tool's parameters and strictness where strict is the default but the tool does
    not say (OpenAI's Responses API, as OpenAI does it): strict when closing every object that
    lists its properties is all the schema lacks, else the schema as given, non-strict (still
    enforced, its objects closed: see closed_objects). LangChain's tools, for one, never say."""
    schema = NO_PARAMETERS if parameters is None else parameters
    try:
        closed = closed_objects(schema)
        check_strict(closed, "parameters")
    except (ConstraintError, RecursionError, TypeError, ValueError):  # the later checks name what is wrong
        return schema, False
    return closed, True


def tool_calling_from_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolCalling | None:
    """The request's tools, checked (ConstraintError: a 400 naming the field), or None without tools."""
    if parallel_tool_calls not in (None, True, False):
        raise ConstraintError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if not tools:
        if isinstance(tool_choice, Mapping) or tool_choice == "required":
            raise ConstraintError("tool_choice", "tool_choice is only allowed when tools are specified")
        return None
    if not isinstance(tools, list):
        raise ConstraintError("tools", "tools must be a list")
    if len(tools) > MAX_TOOLS:
        raise ConstraintError("tools", f"{len(tools)} tools; the limit is {MAX_TOOLS}")
    try:  # a lone surrogate (JSON's \ud800 escape) could not be tokenized when the template renders the tools
        size = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8"))
    except UnicodeEncodeError:
        raise ConstraintError("tools", "the tools contain a lone surrogate (invalid Unicode)") from None
    if size > MAX_TOOLS_BYTES:
        raise ConstraintError("tools", f"the tools are {size} bytes; the limit is {MAX_TOOLS_BYTES}")
    functions = tuple(_function(tool, f"tools.{i}") for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ConstraintError("tools", f"two tools are named {duplicate!r}")
    choice, forced = _tool_choice(tool_choice, names)
    return ToolCalling(functions, choice, forced, parallel=parallel_tool_calls is not False)


def _function(tool: Any, param: str) -> Function:
    if not isinstance(tool, Mapping):
        raise ConstraintError(param, "a tool must be an object")
    if tool.get("type") != "function":
        raise ConstraintError(f"{param}.type", f"tool type {tool.get('type')!r} is not supported; only function")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ConstraintError(f"{param}.function", "a function tool needs a function object")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise ConstraintError(f"{param}.function.name",
                              "a function name is 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ConstraintError(f"{param}.function.description", "a function's description must be a string")
    strict = function.get("strict")
    if strict not in (None, True, False):
        raise ConstraintError(f"{param}.function.strict", "strict must be a boolean")
    parameters = function.get("parameters", NO_PARAMETERS)
    if parameters is None:
        parameters = NO_PARAMETERS
    # The schema's checks (metaschema, strict subset, what llguidance can enforce) are the
    # structured outputs' own.
    checked = json_schema_constraint(parameters, f"{param}.function.parameters", strict=bool(strict), name=name)
    if not isinstance(json.loads(checked.spec), dict) or json.loads(checked.spec).get("type", "object") != "object":
        raise ConstraintError(f"{param}.function.parameters", "a function's parameters must be an object schema")
    return Function(name, checked.spec, bool(strict), json.dumps(tool, ensure_ascii=False))


def _tool_choice(tool_choice: Any, names: list[str]) -> tuple[ToolChoice, str | None]:
    if tool_choice is None:
        return ToolChoice.AUTO, None  # OpenAI's default when tools are given
    if isinstance(tool_choice, str):
        try:
            choice = ToolChoice(tool_choice)
        except ValueError:
            choice = ToolChoice.FUNCTION  # refused just below
        if choice is not ToolChoice.FUNCTION:
            return choice, None
        raise ConstraintError("tool_choice", "tool_choice must be none, auto, required or a named function")
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ConstraintError("tool_choice", "tool_choice must be none, auto, required or "
                                             '{"type": "function", "function": {"name": ...}}')
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), Mapping) \
        else None
    if name not in names:
        raise ConstraintError("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
    return ToolChoice.FUNCTION, name
