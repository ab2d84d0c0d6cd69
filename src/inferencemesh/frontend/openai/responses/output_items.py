"""The output-item state machine of one Responses choice: a message item for its text, a
function_call item per tool call, each added, filled and closed in turn; the stream's events
that announce each step are returned, the items kept (the final Response's output)."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from inferencemesh.frontend.openai.text.pieces import Piece
from inferencemesh.frontend.openai.text.tool_calls import ToolCallDelta


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """One Responses stream event of type `kind` (numbered when it is sent)."""
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
        return events + [event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        events = self._add(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
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
            events.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self.items.index(item), delta=call.arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

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
            events = [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=part["text"], logprobs=[]),
                      event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=copy.deepcopy(part))]
        else:
            events = [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])]
        return events + [event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """The end of the choice: an answer with no output at all is an empty message."""
        events = [] if self.items else self._open_message()
        return events + self.close("incomplete" if finish_reason == "length" else "completed")
