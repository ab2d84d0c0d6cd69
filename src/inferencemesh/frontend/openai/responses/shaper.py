"""Responses' layout of the chat path's pieces: a Response object, or its stream of typed events
(`event: <type>` + `data: <json>`, numbered by sequence_number, no [DONE]).

Stateless: the request's settings a Response echoes travel on the job (Job.echoed), and a
stream's output items and event count on its choice's state (ChoiceState.shaping: a ResponseStream)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.openai.choices import ChoiceRun, ChoiceState
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.responses.output_items import OutputItems, event
from inferencemesh.frontend.openai.shaper import Shaper
from inferencemesh.frontend.openai.text.pieces import Piece

# response.failed's error.code (an enum of OpenAI's) for an error's type; others: server_error
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


@dataclass
class ResponseStream:
    """One Responses choice's stream so far: its output items, and the events sent (the next
    event's sequence_number)."""

    output: OutputItems = field(default_factory=OutputItems)
    sent: int = 0


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage as a Response reports it."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _stream(state: ChoiceState) -> ResponseStream:
    """The Responses stream a choice's state holds (made on first use)."""
    if state.shaping is None:
        state.shaping = ResponseStream()
    assert isinstance(state.shaping, ResponseStream)
    return state.shaping


class ResponsesShaper(Shaper):
    """A Response, or its events, from one choice (Responses has no n)."""

    response_object = chunk_object = "response"

    @staticmethod
    def _response(job: Job, state: ChoiceState, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "id": job.id, "object": "response", "created_at": job.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": ResponsesShaper._incomplete(job, state) if status == "incomplete" else None,
            "model": job.model, "output": copy.deepcopy(output),
            **job.echoed,
        }
        if usage is not None:  # the spec's usage is never null: absent until the response is done
            body["usage"] = response_usage(usage)
        return body

    @staticmethod
    def _incomplete(job: Job, state: ChoiceState) -> dict[str, Any]:
        """Why an output was cut: max_output_tokens when that limit was reached. Otherwise the
        context window filled first, which none of the spec's reasons (max_output_tokens,
        content_filter) says: the details then give no reason rather than a wrong one."""
        limit = job.echoed.get("max_output_tokens")
        return {"reason": "max_output_tokens"} if limit is not None and state.completion_tokens >= limit else {}

    @staticmethod
    def _status(state: ChoiceState) -> str:
        return "incomplete" if state.finish_reason == "length" else "completed"

    # --- a whole response ---

    def choice(self, run: ChoiceRun, pieces: list[Piece]) -> dict[str, Any]:
        output = OutputItems()
        for piece in pieces:
            output.feed(piece)
        output.finish(run.state.finish_reason)
        return {"output": output.items}

    def response(self, runs: Sequence[ChoiceRun], choices: list[dict[str, Any]], usage: dict[str, Any],
                 ) -> dict[str, Any]:
        job, state = runs[0].job, runs[0].state
        return self._response(job, state, self._status(state), choices[0]["output"], usage)

    # --- a stream ---

    def chunk(self, job: Job, state: ChoiceState, choice: dict[str, Any] | None,
              usage: dict[str, Any] | None = None) -> str:
        """The events of one step, numbered in the order they are sent."""
        stream = _stream(state)
        out = []
        for item in (choice or {}).get("events", []):
            item["sequence_number"] = stream.sent
            stream.sent += 1
            data = json.dumps(item, separators=(",", ":"), ensure_ascii=False)
            out.append(f"event: {item['type']}\ndata: {data}\n\n")
        return "".join(out)

    def opening(self, run: ChoiceRun) -> list[dict[str, Any]]:
        snapshot = self._response(run.job, run.state, "in_progress", [], None)
        return [{"events": [event("response.created", response=snapshot),
                            event("response.in_progress", response=copy.deepcopy(snapshot))]}]

    def delta(self, run: ChoiceRun, piece: Piece) -> dict[str, Any]:
        return {"events": _stream(run.state).output.feed(piece)}

    def closing(self, run: ChoiceRun) -> dict[str, Any]:
        return {"events": _stream(run.state).output.finish(run.state.finish_reason)}

    def stream_end(self, runs: Sequence[ChoiceRun], usage: dict[str, Any]) -> list[str]:
        job, state = runs[0].job, runs[0].state
        status = self._status(state)
        response = self._response(job, state, status, _stream(state).output.items, usage)
        return [self.chunk(job, state, {"events": [event(f"response.{status}", response=response)]})]

    def stream_error(self, job: Job, state: ChoiceState, error: dict[str, Any]) -> list[str]:
        """An `error` event (OpenAI's error fields), then `response.failed` carrying the response."""
        body = error.get("error", {})
        code = FAILED_CODES.get(body.get("type", ""), "server_error")
        failed = self._response(job, state, "failed", _stream(state).output.items, None,
                                error={"code": code, "message": body.get("message", "")})
        return [self.chunk(job, state, {"events": [
            event("error", code=body.get("code") or body.get("type"), message=body.get("message", ""),
                  param=body.get("param")),
            event("response.failed", response=failed)]})]

    def logprobs(self, run: ChoiceRun, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        return None  # never asked for: top_logprobs and include are refused
