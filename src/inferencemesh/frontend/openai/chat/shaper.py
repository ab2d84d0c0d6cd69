"""/v1/chat/completions' layout of a choice's pieces: an assistant message (its content, its
tool calls, chat's logprobs shape), or a stream of chat.completion.chunk deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.openai.choices import ChoiceRun
from inferencemesh.frontend.openai.shaper import Shaper
from inferencemesh.frontend.openai.text.pieces import Piece
from inferencemesh.frontend.openai.text.tool_calls import ToolCallDelta, merged_calls


class ChatShaper(Shaper):
    response_object, chunk_object = "chat.completion", "chat.completion.chunk"

    def opening(self, run: ChoiceRun) -> list[dict[str, Any]]:
        return [self._delta(run, {"role": "assistant", "content": ""}, None, None)]

    def delta(self, run: ChoiceRun, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": piece.text} if piece.text or not piece.tool_calls else {}
        if piece.tool_calls:
            delta["tool_calls"] = [self._call_fragment(fragment) for fragment in piece.tool_calls]
        return self._delta(run, delta, None, self.logprobs(run, piece.tokens, piece.logprobs))

    @staticmethod
    def _call_fragment(fragment: ToolCallDelta) -> dict[str, Any]:
        """OpenAI's delta.tool_calls[] entry: the first fragment of a call names it, later ones
        append to its arguments."""
        if fragment.id is None:
            return {"index": fragment.index, "function": {"arguments": fragment.arguments}}
        return {"index": fragment.index, "id": fragment.id, "type": "function",
                "function": {"name": fragment.name, "arguments": fragment.arguments}}

    def closing(self, run: ChoiceRun) -> dict[str, Any]:
        return self._delta(run, {}, run.state.finish_reason, None)

    @staticmethod
    def _delta(run: ChoiceRun, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None,
               ) -> dict[str, Any]:
        return {"index": run.job.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, run: ChoiceRun, pieces: list[Piece]) -> dict[str, Any]:
        content = "".join(piece.text for piece in pieces)
        calls = merged_calls([fragment for piece in pieces for fragment in piece.tool_calls])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"index": run.job.index, "message": message, "logprobs": self.all_logprobs(run, pieces),
                "finish_reason": run.state.finish_reason}

    def logprobs(self, run: ChoiceRun, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        if entries is None:
            return None
        # Every generated token has its entry; only a prompt's first token has none (completions' echo).
        return {"content": self.formatter.chat([e for e in entries if e is not None], run.job.top_logprobs),
                "refusal": None}
