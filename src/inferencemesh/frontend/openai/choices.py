"""Running a request's choices on the engine: every choice admitted together, each one's steps
read as text pieces (text/pieces.py) while its state records what it generated and why it ended,
and its session always released."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import Engine, Step
from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.engine.metrics import FrontendMetrics, RequestTracker
from inferencemesh.frontend.openai.errors import from_engine_error
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.text.pieces import ChoiceText, Piece

log = logging.getLogger("inferencemesh.frontend")


@dataclass
class ChoiceState:
    """What one choice's generation has found so far; its ChoiceRun owns it."""

    finish_reason: str | None = None  # why it ended, once it has (text/pieces.py decides)
    completion_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the choice's text so far ends
    shaping: object | None = None  # its shaper's own state (the Responses stream's output items), made by it


@dataclass
class ChoiceRun:
    """One choice being generated: its job (the same for every choice of a prompt, but for its
    index), the engine's iterator, the first step, its metrics and its state."""

    job: Job
    iterator: AsyncIterator[Step]
    first: Step | None
    tracker: RequestTracker
    counts_prompt: bool  # the first choice of its prompt: the prompt's tokens count once
    state: ChoiceState = field(default_factory=ChoiceState)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage; cached: the prompt tokens the prefix cache supplied (prompt_tokens_details)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def runs_usage(runs: list[ChoiceRun]) -> dict[str, Any]:
    """usage of a response: each prompt once (and its cached tokens), every choice's completion tokens."""
    prompts = [run for run in runs if run.counts_prompt]
    return usage(sum(len(run.job.prompt_ids) for run in prompts), sum(run.state.completion_tokens for run in runs),
                 sum(run.first.cached_tokens for run in prompts if run.first is not None))


async def start_runs(engine: Engine, metrics: FrontendMetrics, jobs: list[Job], n: int) -> list[ChoiceRun]:
    """Every prompt's n choices, admitted together by the engine (it queues the batch until
    that many sessions are free, or refuses it at once), and each choice's first step, so that
    errors at admission (overloaded, not ready, context) still get their HTTP status. Choice j
    of prompt i gets index i * n + j; a prompt's tokens count once, in its choice 0's metrics."""
    slots = [(job, j) for job in jobs for j in range(n)]
    trackers = [metrics.track_request(job.arrival, len(job.prompt_ids) if j == 0 else 0) for job, j in slots]
    iterators: list[AsyncIterator[Step]] = []
    try:
        if len(slots) == 1:
            iterators = [engine.generate(jobs[0].request)]
        else:
            iterators = list(await engine.generate_batch([job.request for job in jobs], n))
        firsts = await asyncio.gather(*(_next_step(it) for it in iterators), return_exceptions=True)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            raise failure
    except BaseException as exc:
        for tracker in trackers:
            tracker.finish("error" if isinstance(exc, EngineError) else "abort")
        for it in iterators:
            await close_iterator(it)
        if isinstance(exc, EngineError):
            raise from_engine_error(exc) from exc
        raise
    return [ChoiceRun(replace(job, index=job.index * n + j), it, first, tracker, j == 0)
            for (job, j), it, first, tracker in zip(slots, iterators, firsts, trackers, strict=True)
            if not isinstance(first, BaseException)]


async def close_runs(runs: list[ChoiceRun]) -> None:
    """Release every choice's session (a no-op for those done already)."""
    for run in runs:
        await close_iterator(run.iterator)
        run.tracker.finish("abort")  # no-op when already finished


async def close_iterator(iterator: AsyncIterator[Step]) -> None:
    """Close the engine iterator even from a cancelled task: this is what releases the session."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except Exception:
                log.exception("closing the engine iterator failed")


async def choice_pieces(run: ChoiceRun, tokenizer: PreTrainedTokenizerBase) -> AsyncIterator[Piece]:
    """The pieces of one choice as its steps come; run.state records its tokens and, at the end,
    why it ended. The engine's steps never exceed the choice's budget, and its last says why the
    stream ended (engine/stopping.py): nothing is clipped or decided about lengths here."""
    job = run.job
    calls = job.tools.parser() if job.tools is not None and job.tools.may_call else None
    text = ChoiceText(tokenizer, job.prompt_ids, job.stops, min_tokens=job.request.min_tokens,
                      include_stop=job.request.emit_stop_token, calls=calls)
    step, last = run.first, run.first
    while step is not None:
        last = step
        if step:
            run.state.completion_tokens += len(step)
            run.tracker.on_tokens(len(step))
        piece = text.piece(step)
        if piece is not None:
            yield piece
        if text.stopped or step.finish_reason is not None:
            break
        step = await _next_step(run.iterator)
    tail = text.tail()
    if tail is not None:
        yield tail
    run.state.finish_reason = text.finish_reason(last.finish_reason if last is not None else None)


async def _next_step(iterator: AsyncIterator[Step]) -> Step | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
