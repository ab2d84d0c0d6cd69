"""Tool calls parsed back out of a choice's text as it streams, in the format the grammar
(tools.py) makes the model write: Hermes' (Qwen2.5's, and the bundled models' chat template),

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

parallel calls following one another, separated by a newline.

Content before a call is decided is held back only while it could still be the start of
"<tool_call>"; a call's name is sent as soon as it is complete, its arguments as they come. An
output cut by the length limit never leaks the format's markup: a call keeps only the arguments
written inside it, one cut before its arguments is dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "}\n</tool_call>"  # the wrapper object's closing brace, then the tag
CALL_SEPARATOR = "\n"  # between parallel calls
ARGUMENTS_KEY = '", "arguments": '


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of a tool call the model is writing (OpenAI's streamed delta.tool_calls[]): the
    first fragment of call `index` carries its id and function name, later ones only append to
    its arguments (JSON text)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits one choice's output text, as it streams, into content and tool-call fragments."""

    def __init__(self, new_id: Callable[[], str] = new_call_id, *, text_allowed: bool = True) -> None:
        self._new_id = new_id
        self._text_allowed = text_allowed  # False: the grammar allows only calls (required, named)
        self._buffer = ""
        self._state = "start"  # start | text | head | arguments | between
        self._arguments = ""  # the open call's arguments sent so far
        self.calls = 0  # calls begun

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and the call fragments that text completes (some may be held back)."""
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), _coalesced(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, at the end of the output. A call cut short (the length limit) keeps
        the arguments the model wrote inside it, never the wrapper's markup; a call cut before its
        arguments began is dropped (its name may be cut too); neither ever becomes content."""
        rest, self._buffer = self._buffer, ""
        if self._state == "arguments":
            # rest is what _step held back: the start of CALL_CLOSE, or the arguments' own last "}"
            if rest and not (rest.startswith(CALL_CLOSE[:2]) or _is_json(self._arguments)):
                return "", [ToolCallDelta(self.calls - 1, rest)]
            return "", []
        if self._state in ("between", "head"):
            return "", []  # a separator, or a call's start, the output ended in
        if self._state == "start" and not self._text_allowed:
            return "", []  # only calls were allowed: the start of one
        return rest, []  # text, or (auto) text that only looked like a call's start: nothing is lost

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One transition; False when it needs more text."""
        buffer = self._buffer
        if self._state in ("start", "between"):
            opening = (CALL_SEPARATOR if self._state == "between" else "") + CALL_OPEN
            if buffer.startswith(opening):
                self._buffer, self._state = buffer[len(opening):], "head"
                return True
            if opening.startswith(buffer):
                return False  # could still be a call
            self._state = "text"
            return True
        if self._state == "text":
            content.append(buffer)
            self._buffer = ""
            return False
        if self._state == "head":
            if not buffer.startswith('{"name": "'[: len(buffer)]):
                self._state, self._buffer = "text", CALL_OPEN + buffer  # not a call after all
                return True
            end = buffer.find(ARGUMENTS_KEY)
            if end < 0:
                return False
            deltas.append(ToolCallDelta(self.calls, "", id=self._new_id(), name=buffer[len('{"name": "'):end]))
            self.calls += 1
            self._arguments = ""
            self._buffer, self._state = buffer[end + len(ARGUMENTS_KEY):], "arguments"
            return True
        # arguments: up to the call's closing; a raw newline cannot occur inside compact JSON
        end = buffer.find(CALL_CLOSE)
        if end >= 0:
            if end:
                deltas.append(ToolCallDelta(self.calls - 1, buffer[:end]))
            self._buffer, self._state = buffer[end + len(CALL_CLOSE):], "between"
            return True
        keep = next((n for n in range(min(len(buffer), len(CALL_CLOSE) - 1), 0, -1)
                     if CALL_CLOSE.startswith(buffer[-n:])), 0)
        if len(buffer) > keep:
            deltas.append(ToolCallDelta(self.calls - 1, buffer[: len(buffer) - keep]))
            self._arguments += buffer[: len(buffer) - keep]
            self._buffer = buffer[len(buffer) - keep:]
        return False


def _is_json(text: str) -> bool:
    """Whether text is one whole JSON value (a call's arguments complete: a "}" after them is the wrapper's)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _coalesced(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One fragment per call: a call's name and the arguments after it in the same text go together."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index and delta.id is None:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments, last.id, last.name)
        else:
            out.append(delta)
    return out


def merged_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A choice's fragments as whole tool calls, OpenAI's message.tool_calls."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.id is not None:
            call["id"] = delta.id
        if delta.name is not None:
            call["function"]["name"] = delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[index] for index in sorted(calls)]
