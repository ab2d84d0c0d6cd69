"""The base of the endpoints' shapers: how an endpoint lays out a request's generated pieces, as
one response or as its stream of server-sent events. Each endpoint's folder holds its own
(chat/shaper.py, completions/shaper.py, responses/shaper.py). A shaper keeps no state of its
own: what one choice's answer needs as it streams lives in that choice's ChoiceState."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.openai.choices import ChoiceRun, ChoiceState
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.logprobs import LogprobsFormatter
from inferencemesh.frontend.openai.sse import DONE, sse
from inferencemesh.frontend.openai.text.pieces import Piece


class Shaper:
    """The layout of one endpoint's answers; the subclasses fill in what differs."""

    response_object: str
    chunk_object: str

    def __init__(self, logprobs: LogprobsFormatter) -> None:
        self.formatter = logprobs

    def response(self, runs: Sequence[ChoiceRun], choices: list[dict[str, Any]], usage: dict[str, Any],
                 ) -> dict[str, Any]:
        """A non-streamed response: its choices (each from `choice`), in the order of runs."""
        job = runs[0].job
        return {"id": job.id, "object": self.response_object, "created": job.created, "model": job.model,
                "choices": choices, "usage": usage}

    def chunk(self, job: Job, state: ChoiceState, choice: dict[str, Any] | None,
              usage: dict[str, Any] | None = None) -> str:
        """One SSE event of a stream: a choice's delta, or (choice None) the usage at the end."""
        obj: dict[str, Any] = {"id": job.id, "object": self.chunk_object, "created": job.created,
                               "model": job.model, "choices": [] if choice is None else [choice]}
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    def stream_end(self, runs: Sequence[ChoiceRun], usage: dict[str, Any]) -> list[str]:
        """The events that end a stream once every choice is done: usage (when asked), [DONE]."""
        job, state = runs[0].job, runs[0].state
        return ([self.chunk(job, state, None, usage)] if job.include_usage else []) + [DONE]

    def stream_error(self, job: Job, state: ChoiceState, error: dict[str, Any]) -> list[str]:
        """The events that end a stream that failed after its headers went out (error: OpenAI's
        body); state: its first choice's (a fresh one when no choice had started)."""
        return [sse(error), DONE]

    def opening(self, run: ChoiceRun) -> list[dict[str, Any]]:
        """The choice deltas a stream sends before the first generated piece."""
        raise NotImplementedError

    def delta(self, run: ChoiceRun, piece: Piece) -> dict[str, Any]:
        """A streamed choice's delta carrying one piece."""
        raise NotImplementedError

    def closing(self, run: ChoiceRun) -> dict[str, Any]:
        """A streamed choice's last delta: no text, its finish reason."""
        raise NotImplementedError

    def choice(self, run: ChoiceRun, pieces: list[Piece]) -> dict[str, Any]:
        """A non-streamed response's choice, from all its pieces."""
        raise NotImplementedError

    def logprobs(self, run: ChoiceRun, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (None when the request asked for none)."""
        raise NotImplementedError

    def all_logprobs(self, run: ChoiceRun, pieces: list[Piece]) -> dict[str, Any] | None:
        """The choice's `logprobs` for all its pieces' tokens."""
        tokens = [t for piece in pieces for t in piece.tokens]
        entries = None if run.job.request.logprobs is None else [e for p in pieces for e in p.logprobs or []]
        return self.logprobs(run, tokens, entries)
