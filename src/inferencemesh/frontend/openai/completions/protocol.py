"""The body of POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from inferencemesh.frontend.openai.protocol import MAX_LOGPROBS, Int, SamplingRequest, Text


class CompletionRequest(SamplingRequest):
    # A string, token ids, or a batch of either: one response, n choices per prompt.
    # null or absent: OpenAI generates "as if from the beginning of a new document" (the BOS token alone)
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=64)] | list[Int] | \
        Annotated[list[list[Int]], Field(min_length=1, max_length=64)] | None = None
    echo: bool | None = None
    suffix: Text | None = None
    best_of: Annotated[Int, Field(ge=1)] | None = None
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # OpenAI: up to 5; vLLM: 20
    add_special_tokens: bool | None = None  # vLLM: add BOS etc. to a text prompt (default true)

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            return "max_tokens", "max_tokens 0 scores the prompt: it needs echo and logprobs"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (text or token ids): a batch runs them concurrently."""
        p = "" if self.prompt is None else self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]  # a list of prompts: strings or id lists
        return [p]  # type: ignore[list-item]  # one prompt: a string or a list of ids
