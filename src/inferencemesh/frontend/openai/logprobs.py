"""Logprobs in OpenAI's two shapes: chat's `logprobs.content[]` and completions' parallel lists.

The engine hands over TokenLogprob entries (the raw model's log-probabilities, computed at the
last stage); this module only names the tokens and lays the numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; vLLM floors the same way


def _number(logprob: float) -> float:
    return max(float(logprob), FLOOR)


class LogprobsFormatter:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        """A token's own text, as vLLM names it (a lone byte of a UTF-8 character shows as U+FFFD)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = str(self.tokenizer.decode([token]))
        return text

    def _named(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": _number(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, entries: Sequence[TokenLogprob], top: int) -> list[dict[str, Any]]:
        """ChatCompletionTokenLogprob items: the chosen token and its `top` most likely alternatives."""
        return [{**self._named(e.token, e.logprob), "top_logprobs": [self._named(t, lp) for t, lp in e.top[:top]]}
                for e in entries]

    def completion(self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], top: int,
                   offset: int) -> tuple[dict[str, Any], int]:
        """The completions `logprobs` object for these tokens, with text offsets from `offset`
        (where the choice's text so far ends); returns it and the offset after it. An entry of
        None (an echoed prompt's first token) has null logprobs, as in OpenAI's and vLLM's answers.
        top_logprobs holds the chosen token and the `top` most likely ones, as OpenAI defines it."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(tokens, entries, strict=True):
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_number(entry.logprob))
            alternatives = {text: _number(entry.logprob)}
            for t, lp in entry.top[:top]:
                alternatives.setdefault(self.text(t), _number(lp))
            out["top_logprobs"].append(alternatives)
        return out, offset
