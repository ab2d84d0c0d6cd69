"""/v1/completions' layout of a choice's pieces: its text (after the echoed prompt, with echo),
completions' logprobs shape (parallel lists with text offsets), or a stream of text_completion
chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.openai.choices import ChoiceRun
from inferencemesh.frontend.openai.shaper import Shaper
from inferencemesh.frontend.openai.text.pieces import Piece


class CompletionShaper(Shaper):
    response_object = chunk_object = "text_completion"

    def opening(self, run: ChoiceRun) -> list[dict[str, Any]]:
        if not run.job.echo_text:
            return []
        echo, echo_logprobs = self._echo(run)
        return [self._choice(run, echo, None, echo_logprobs)]

    def delta(self, run: ChoiceRun, piece: Piece) -> dict[str, Any]:
        return self._choice(run, piece.text, None, self.logprobs(run, piece.tokens, piece.logprobs))

    def closing(self, run: ChoiceRun) -> dict[str, Any]:
        return self._choice(run, "", run.state.finish_reason, None)

    @staticmethod
    def _choice(run: ChoiceRun, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": run.job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, run: ChoiceRun, pieces: list[Piece]) -> dict[str, Any]:
        echo, echo_logprobs = self._echo(run)
        logprobs = self.all_logprobs(run, pieces)
        if echo_logprobs is not None:  # the prompt's entries first, then the generated tokens'
            logprobs = {key: echo_logprobs[key] + (logprobs or {}).get(key, []) for key in echo_logprobs}
        return self._choice(run, echo + "".join(piece.text for piece in pieces), run.state.finish_reason, logprobs)

    def _echo(self, run: ChoiceRun) -> tuple[str, dict[str, Any] | None]:
        """With echo: the prompt's text and, with logprobs, the prompt's logprobs."""
        job = run.job
        prompt_logprobs = run.first.prompt_logprobs if run.first is not None else None
        if job.request.prompt_logprobs is None or prompt_logprobs is None:
            return job.echo_text, None
        return job.echo_text, self.logprobs(run, job.prompt_ids, prompt_logprobs)

    def logprobs(self, run: ChoiceRun, tokens: list[int], entries: Sequence[TokenLogprob | None] | None,
                 ) -> dict[str, Any] | None:
        if entries is None:
            return None
        state = run.state
        out, state.text_offset = self.formatter.completion(tokens, entries, run.job.top_logprobs, state.text_offset)
        return out
