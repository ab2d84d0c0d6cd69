"""When a choice's token stream ends, and why: the only place the engine decides it.

A choice ends at the first of:
- a stop token (the request's stop_token_ids) generated at or after min_tokens tokens: "stop".
  The stop token itself is not yielded, unless the request asks for it (emit_stop_token); then
  it is the last token yielded, and counts in the budget;
- its token budget, the request's max_tokens within the room the model's context leaves after
  the prompt: "length".

The stages never sample a stop token before min_tokens (sampling.adjust masks them), as vLLM's
sampler does not; the rule counts min_tokens too, as vLLM's stop checker does, so that it holds
whatever decided the tokens.

A step may decide several tokens (a verified speculative window); those past the end are
dropped here, so a choice never yields more than its budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferencemesh.frontend.engine.api import FinishReason, GenerationRequest


def token_budget(max_tokens: int, prompt_tokens: int, max_context: int) -> int:
    """The most tokens a choice may yield: max_tokens, within the room the model's context
    leaves after the prompt (never below 0)."""
    return max(0, min(max_tokens, max_context - prompt_tokens))


@dataclass(frozen=True)
class StopRule:
    """What ends one choice (see the module's doc); every choice of a request has the same."""

    budget: int  # tokens the choice may yield (token_budget)
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # a stop token ends nothing before this many tokens were generated
    emit_stop_token: bool = False  # the stop token that ends the choice is yielded, as its last

    @classmethod
    def of(cls, request: GenerationRequest, max_context: int) -> StopRule:
        """The rule of a request's choices on a model of max_context tokens."""
        return cls(token_budget(request.max_tokens, len(request.prompt_ids), max_context),
                   frozenset(request.stop_token_ids), request.min_tokens, request.emit_stop_token)

    def stops_at(self, token: int, generated: int) -> bool:
        """Whether `token`, generated after `generated` others, is a stop token that ends the choice."""
        return token in self.stop_token_ids and generated >= self.min_tokens


@dataclass(frozen=True)
class Cut:
    """What one step of a choice yields: its first `count` tokens; finish_reason on its last step."""

    count: int
    finish_reason: FinishReason | None


class ChoiceStopping:
    """One choice's stream held to its StopRule: the engine passes every step's decided tokens
    through `cut`, and yields what it says."""

    def __init__(self, rule: StopRule) -> None:
        self.rule = rule
        self.generated = 0  # tokens decided so far, stop tokens included (what min_tokens counts)
        self.yielded = 0  # tokens yielded so far: never more than rule.budget
        self.finish_reason: FinishReason | None = None  # set once the choice has ended

    def decided(self, tokens: Sequence[int]) -> list[int]:
        """A step's tokens before the first stop token that ends the choice, whatever the budget:
        what the choice's grammar advances by."""
        for index, token in enumerate(tokens):
            if self.rule.stops_at(token, self.generated + index):
                return list(tokens[:index])
        return list(tokens)

    def cut(self, tokens: Sequence[int]) -> Cut:
        """How many of a step's tokens the choice yields, and finish_reason when this step ends it.
        A choice that has ended yields nothing more."""
        if self.finish_reason is not None:
            return Cut(0, None)
        room = self.rule.budget - self.yielded
        count = min(len(tokens), room)
        reason: FinishReason | None = None
        for index, token in enumerate(tokens[:room]):
            if self.rule.stops_at(token, self.generated + index):
                count, reason = index + int(self.rule.emit_stop_token), "stop"
                break
        self.generated += len(tokens)
        self.yielded += count
        if reason is None and self.yielded >= self.rule.budget:
            reason = "length"
        self.finish_reason = reason
        return Cut(count, reason)
