"""A choice's steps as text pieces (frontend/openai/text/pieces.py): the only place text-level
decisions are made, and it knows no token budget. The engine's last Step says why a stream ended;
the text adds "stop" for a stop string it ended at and "tool_calls" for a choice that called tools,
and never clips or re-decides a length.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.api import FinishReason, Step
from inferencemesh.frontend.openai.text.pieces import ChoiceText, Piece
from inferencemesh.frontend.openai.text.tool_calls import ToolCallParser


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))


def steps_of(tokenizer: PreTrainedTokenizerBase, text: str, reason: FinishReason | None = "length") -> list[Step]:
    """text's tokens, one Step each, the last carrying reason (as the engine's last Step does)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [Step([t], None, finish_reason=reason if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def read(text: ChoiceText, steps: list[Step]) -> tuple[list[Piece], str]:
    """The pieces of steps, read as choices.choice_pieces reads them, and the finish reason."""
    pieces: list[Piece] = []
    reason: FinishReason | None = None
    for step in steps:
        reason = step.finish_reason or reason
        piece = text.piece(step)
        if piece is not None:
            pieces.append(piece)
        if text.stopped:
            break
    tail = text.tail()
    return pieces + ([tail] if tail is not None else []), text.finish_reason(reason)


def test_the_engines_reason_is_kept_and_every_token_counts(tokenizer: PreTrainedTokenizerBase) -> None:
    for reason in ("length", "stop"):
        steps = steps_of(tokenizer, "one two three four five", reason)
        pieces, finish = read(ChoiceText(tokenizer, [], []), steps)
        assert finish == reason
        assert "".join(p.text for p in pieces) == "one two three four five"
        assert sum(len(p.tokens) for p in pieces) == len(steps)  # nothing clipped: the engine holds the budget


def test_a_stop_string_ends_the_text_with_stop(tokenizer: PreTrainedTokenizerBase) -> None:
    pieces, finish = read(ChoiceText(tokenizer, [], [" three"]), steps_of(tokenizer, "one two three four five"))
    assert finish == "stop" and "".join(p.text for p in pieces) == "one two"


def test_a_choice_that_called_tools_ends_with_tool_calls(tokenizer: PreTrainedTokenizerBase) -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    stopped = ChoiceText(tokenizer, [], [], calls=ToolCallParser(text_allowed=False))
    pieces, finish = read(stopped, steps_of(tokenizer, call, "stop"))
    assert finish == "tool_calls" and [p.text for p in pieces if p.text] == []
    assert [c.name for p in pieces for c in p.tool_calls if c.name] == ["f"]
    # a call cut by the length limit stays "length"
    _, finish = read(ChoiceText(tokenizer, [], [], calls=ToolCallParser()), steps_of(tokenizer, call[:30]))
    assert finish == "length"


def test_steps_that_end_without_a_reason_are_an_engine_error(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(RuntimeError, match="without saying why"):
        read(ChoiceText(tokenizer, [], []), steps_of(tokenizer, "one", reason=None))
