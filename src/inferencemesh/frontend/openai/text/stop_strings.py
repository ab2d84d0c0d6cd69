"""Stop strings that never leak into the output, and a choice's text: detokenized, cut at a stop string.

Stop strings can straddle tokens ("\\n\\n" from "\\n" + "\\n"), so text that could be the start
of a stop string is held back until the next tokens prove it is not.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.openai.text.detokenize import IncrementalDetokenizer


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include  # vLLM's include_stop_str_in_output: the stop string ends the text
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Feed text; return (text safe to emit, whether a stop string was found)."""
        if not self._stops:
            return text, False
        pending = self._pending + text
        hits = [(i, -len(s), s) for s, i in ((s, pending.find(s)) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            at, _, stop = min(hits)  # the earliest; of those starting there, the longest
            return pending[:at + len(stop) if self._include else at], True
        hold = max((self._partial_suffix(pending, s) for s in self._stops), default=0)
        cut = len(pending) - hold
        self._pending = pending[cut:]
        return pending[:cut], False

    @staticmethod
    def _partial_suffix(text: str, stop: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of stop."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class OutputText:
    """The text of one generation: detokenized, with stop strings cut out (or kept, with
    include_stop), looked for only once more than min_tokens tokens were generated (vLLM's rule)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stops: Sequence[str],
                 *, min_tokens: int = 0, include_stop: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stops, include_stop)
        self._min_tokens = min_tokens
        self._tokens = 0
        self.stopped = False  # a stop string was seen: the caller ends generation

    def add_tokens(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._tokens += len(ids)
        text = self._detok.add(ids)
        if self._tokens <= self._min_tokens:
            return text
        out, self.stopped = self._stops.push(text)
        return out

    def finish(self) -> str:
        """Generation ended by the engine: the held-back rest (still cut at a stop string)."""
        if self.stopped:
            return ""
        out, self.stopped = self._stops.push(self._detok.flush())
        return out if self.stopped else out + self._stops.flush()
