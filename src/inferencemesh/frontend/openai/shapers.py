"""One shaper per endpoint: how /v1/chat/completions and /v1/completions lay out the same
generated pieces (a chat message or delta, a completion's text; their two logprobs shapes; a
completion's echoed prompt; a chat message's tool calls)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferencemesh.frontend.engine.api import Step, TokenLogprob
from inferencemesh.frontend.openai.generation import Piece, Run
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.logprobs import LogprobsFormatter
from inferencemesh.frontend.openai.sse import DONE, sse
from inferencemesh.frontend.openai.tools import ToolCallDelta, merged_calls


class Shaper:
    """The layout of one endpoint's answers; the subclasses fill in what differs."""

    response_object: str
    chunk_object: str

    def __init__(self, logprobs: LogprobsFormatter) -> None:
        self.formatter = logprobs

    def response(self, job: Job, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": job.id, "object": self.response_object, "created": job.created, "model": job.model,
                "choices": choices, "usage": usage}

    def chunk(self, job: Job, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
        """One SSE event of a stream: a choice's delta, or (choice None) the usage at the end."""
        obj: dict[str, Any] = {"id": job.id, "object": self.chunk_object, "created": job.created,
                               "model": job.model, "choices": [] if choice is None else [choice]}
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    def stream_end(self, job: Job, usage: dict[str, Any]) -> list[str]:
        """The events that end a stream once every choice is done: usage (when asked), [DONE]."""
        return ([self.chunk(job, None, usage)] if job.include_usage else []) + [DONE]

    def stream_error(self, job: Job, error: dict[str, Any]) -> list[str]:
        """The events that end a stream that failed after its headers went out (error: OpenAI's body)."""
        return [sse(error), DONE]

    def opening(self, run: Run) -> list[dict[str, Any]]:
        """The choice deltas a stream sends before the first generated piece."""
        raise NotImplementedError

    def delta(self, job: Job, piece: Piece) -> dict[str, Any]:
        """A streamed choice's delta carrying one piece."""
        raise NotImplementedError

    def closing(self, job: Job) -> dict[str, Any]:
        """A streamed choice's last delta: no text, its finish reason."""
        raise NotImplementedError

    def choice(self, run: Run, pieces: list[Piece]) -> dict[str, Any]:
        """A non-streamed response's choice, from all its pieces."""
        raise NotImplementedError

    def logprobs(self, job: Job, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (None when the request asked for none)."""
        raise NotImplementedError

    def _all_logprobs(self, run: Run, pieces: list[Piece]) -> dict[str, Any] | None:
        tokens = [t for piece in pieces for t in piece.tokens]
        entries = None if run.job.request.logprobs is None else [e for p in pieces for e in p.logprobs or []]
        return self.logprobs(run.job, tokens, entries)


class ChatShaper(Shaper):
    response_object, chunk_object = "chat.completion", "chat.completion.chunk"

    def opening(self, run: Run) -> list[dict[str, Any]]:
        return [self._delta(run.job, {"role": "assistant", "content": ""}, None, None)]

    def delta(self, job: Job, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": piece.text} if piece.text or not piece.tool_calls else {}
        if piece.tool_calls:
            delta["tool_calls"] = [self._call_fragment(fragment) for fragment in piece.tool_calls]
        return self._delta(job, delta, None, self.logprobs(job, piece.tokens, piece.logprobs))

    @staticmethod
    def _call_fragment(fragment: ToolCallDelta) -> dict[str, Any]:
        """OpenAI's delta.tool_calls[] entry: the first fragment of a call names it, later ones
        append to its arguments."""
        if fragment.id is None:
            return {"index": fragment.index, "function": {"arguments": fragment.arguments}}
        return {"index": fragment.index, "id": fragment.id, "type": "function",
                "function": {"name": fragment.name, "arguments": fragment.arguments}}

    def closing(self, job: Job) -> dict[str, Any]:
        return self._delta(job, {}, job.finish_reason, None)

    @staticmethod
    def _delta(job: Job, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None,
               ) -> dict[str, Any]:
        return {"index": job.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, run: Run, pieces: list[Piece]) -> dict[str, Any]:
        content = "".join(piece.text for piece in pieces)
        calls = merged_calls([fragment for piece in pieces for fragment in piece.tool_calls])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"index": run.job.index, "message": message, "logprobs": self._all_logprobs(run, pieces),
                "finish_reason": run.job.finish_reason}

    def logprobs(self, job: Job, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        if entries is None:
            return None
        # Every generated token has its entry; only a prompt's first token has none (completions' echo).
        return {"content": self.formatter.chat([e for e in entries if e is not None], job.top_logprobs),
                "refusal": None}


class CompletionShaper(Shaper):
    response_object = chunk_object = "text_completion"

    def opening(self, run: Run) -> list[dict[str, Any]]:
        if not run.job.echo_text:
            return []
        echo, echo_logprobs = self._echo(run.job, run.first)
        return [self._choice(run.job, echo, None, echo_logprobs)]

    def delta(self, job: Job, piece: Piece) -> dict[str, Any]:
        return self._choice(job, piece.text, None, self.logprobs(job, piece.tokens, piece.logprobs))

    def closing(self, job: Job) -> dict[str, Any]:
        return self._choice(job, "", job.finish_reason, None)

    @staticmethod
    def _choice(job: Job, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, run: Run, pieces: list[Piece]) -> dict[str, Any]:
        job = run.job
        echo, echo_logprobs = self._echo(job, run.first)
        logprobs = self._all_logprobs(run, pieces)
        if echo_logprobs is not None:  # the prompt's entries first, then the generated tokens'
            logprobs = {key: echo_logprobs[key] + (logprobs or {}).get(key, []) for key in echo_logprobs}
        return self._choice(job, echo + "".join(piece.text for piece in pieces), job.finish_reason, logprobs)

    def _echo(self, job: Job, first: Step | None) -> tuple[str, dict[str, Any] | None]:
        """With echo: the prompt's text and, with logprobs, the prompt's logprobs."""
        prompt_logprobs = first.prompt_logprobs if first is not None else None
        if job.request.prompt_logprobs is None or prompt_logprobs is None:
            return job.echo_text, None
        return job.echo_text, self.logprobs(job, job.prompt_ids, prompt_logprobs)

    def logprobs(self, job: Job, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        if entries is None:
            return None
        out, job.text_offset = self.formatter.completion(tokens, entries, job.top_logprobs, job.text_offset)
        return out
