"""A choice's steps become the client's text pieces here, and only here: detokenized
(detokenize.py), cut at a stop string (stop_strings.py), tool calls parsed out (tool_calls.py),
and why the choice ended as its text tells it.

Nothing here knows a token budget: the engine ends a choice's stream, and its last Step says why
(engine/stopping.py: a stop token is "stop", max_tokens or the context "length"). The text only
adds its own "stop", a stop string it ended at, and "tool_calls", a choice that stopped after
calling tools (finish_reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import FinishReason, Step, TokenLogprob
from inferencemesh.frontend.openai.text.stop_strings import OutputText
from inferencemesh.frontend.openai.text.tool_calls import ToolCallDelta, ToolCallParser


@dataclass(frozen=True)
class Piece:
    """One engine step as the client sees it: new text (a message's content), the logprobs of its
    tokens, and the tool-call fragments its text completed."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceText:
    """One choice's text as its steps arrive: `piece` for each step, `tail` once the steps end
    (or `stopped` says a stop string ended the text: no later step counts), then `finish_reason`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stops: Sequence[str], *,
                 min_tokens: int = 0, include_stop: bool = False, calls: ToolCallParser | None = None) -> None:
        self._text = OutputText(tokenizer, prompt_ids, stops, min_tokens=min_tokens, include_stop=include_stop)
        self._calls = calls  # None: the request has no tools the model may call; its text is content

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text."""
        return self._text.stopped

    def piece(self, step: Step) -> Piece | None:
        """The piece of one step; None when it adds nothing a client sees yet (text held back)."""
        ids = list(step)
        if not ids:
            return None
        logprobs = step.logprobs
        piece = self._parsed(Piece(self._text.add_tokens(ids), ids, logprobs))
        return piece if piece.text or piece.tool_calls or logprobs else None

    def tail(self) -> Piece | None:
        """What was held back, once the steps ended: the rest of the text, a call's last fragments."""
        tail = self._parsed(Piece("" if self._text.stopped else self._text.finish(), [], None))
        if self._calls is not None:
            held, fragments = self._calls.finish()
            tail = Piece(tail.text + held, [], None, tail.tool_calls + fragments)
        return tail if tail.text or tail.tool_calls else None

    def finish_reason(self, engine_reason: FinishReason | None) -> str:
        """Why the choice ended, as the client is told: "stop" when a stop string ended the text,
        else the engine's reason (its last Step's); a choice that stopped after calling tools
        ends as OpenAI's do, "tool_calls"."""
        if self._text.stopped:
            reason: str = "stop"
        elif engine_reason is None:
            raise RuntimeError("the engine ended a choice's steps without saying why (its last Step's finish_reason)")
        else:
            reason = engine_reason
        if reason == "stop" and self._calls is not None and self._calls.calls:
            return "tool_calls"
        return reason

    def _parsed(self, piece: Piece) -> Piece:
        """piece with its tool-call markup parsed out of the text (no tools: as it is)."""
        if self._calls is None or not piece.text:
            return piece
        content, fragments = self._calls.feed(piece.text)
        return Piece(content, piece.tokens, piece.logprobs, fragments)
