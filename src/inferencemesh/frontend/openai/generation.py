"""Running jobs on the engine: every choice admitted together, its steps turned into text
pieces (stop strings, the token budget, why it ended), and its session always released."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from fastapi import Request
from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import Engine, Step, TokenLogprob
from inferencemesh.frontend.engine.errors import EngineError
from inferencemesh.frontend.engine.metrics import FrontendMetrics, RequestTracker
from inferencemesh.frontend.openai.detokenize import OutputText
from inferencemesh.frontend.openai.errors import from_engine_error
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.tools import ToolCallDelta, ToolCallParser

log = logging.getLogger("inferencemesh.frontend")

T = TypeVar("T")


@dataclass
class Piece:
    """One engine step as the client sees it: new text (a message's content), the logprobs of its
    tokens, and the tool-call fragments its text completed (tools.py parses them out of the text)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Run:
    """One choice being generated: its own job (index, finish reason, counts), the engine's
    iterator, the first step, and its metrics."""

    job: Job
    iterator: AsyncIterator[Step]
    first: Step | None
    tracker: RequestTracker
    counts_prompt: bool  # the first choice of its prompt: the prompt's tokens count once


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage; cached: the prompt tokens the prefix cache supplied (prompt_tokens_details)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def runs_usage(runs: list[Run]) -> dict[str, Any]:
    """usage of a response: each prompt once (and its cached tokens), every choice's completion tokens."""
    prompts = [run for run in runs if run.counts_prompt]
    return usage(sum(len(run.job.prompt_ids) for run in prompts), sum(run.job.completion_tokens for run in runs),
                 sum(run.first.cached_tokens for run in prompts if run.first is not None))


async def start_runs(engine: Engine, metrics: FrontendMetrics, jobs: list[Job], n: int) -> list[Run]:
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
        firsts = await asyncio.gather(*(_first_step(it) for it in iterators), return_exceptions=True)
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
    return [Run(replace(job, index=job.index * n + j), it, first, tracker, j == 0)
            for (job, j), it, first, tracker in zip(slots, iterators, firsts, trackers, strict=True)
            if not isinstance(first, BaseException)]


async def close_runs(runs: list[Run]) -> None:
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


async def _first_step(iterator: AsyncIterator[Step]) -> Step | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


def output_text(job: Job, tokenizer: PreTrainedTokenizerBase) -> OutputText:
    """The detokenizer of one choice: its prompt as context, its stop strings, min_tokens."""
    return OutputText(tokenizer, job.prompt_ids, job.stops, min_tokens=job.request.min_tokens,
                      include_stop=job.request.emit_stop_token)


async def pieces(run: Run, text: OutputText) -> AsyncIterator[Piece]:
    """The pieces of one choice; sets job.finish_reason and job.completion_tokens at the end."""
    job, iterator, step = run.job, run.iterator, run.first
    budget = job.request.max_tokens
    count = 0
    engine_reason: str | None = None
    calls = job.tools.parser() if job.tools is not None and job.tools.may_call else None
    while step is not None:
        engine_reason = step.finish_reason or engine_reason
        ids = list(step[: budget - count])  # a speculative step may overshoot the budget
        logprobs = step.logprobs[: len(ids)] if step.logprobs is not None else None
        if ids:
            count += len(ids)
            run.tracker.on_tokens(len(ids))
            delta = text.add_tokens(ids)
            piece = _parsed(Piece(delta, ids, logprobs), calls)
            if piece.text or piece.tool_calls or logprobs:
                yield piece
        if text.stopped or count >= budget:
            break
        try:
            step = await iterator.__anext__()
        except StopAsyncIteration:
            step = None
    tail = _parsed(Piece("" if text.stopped else text.finish(), [], None), calls)
    if calls is not None:
        held, fragments = calls.finish()
        tail = Piece(tail.text + held, [], None, tail.tool_calls + fragments)
    if tail.text or tail.tool_calls:
        yield tail
    job.completion_tokens = count
    # The engine says why a choice ended (a stop token, or its length); a stop string is
    # found here, in the text, and is a "stop" too. A choice that stopped after calling tools
    # ends as OpenAI's do: "tool_calls".
    job.finish_reason = "stop" if text.stopped else engine_reason or "length"
    if calls is not None and calls.calls and job.finish_reason == "stop":
        job.finish_reason = "tool_calls"


def _parsed(piece: Piece, calls: ToolCallParser | None) -> Piece:
    """piece with its tool-call markup parsed out of the text (calls None: no tools, as it is)."""
    if calls is None or not piece.text:
        return piece
    content, fragments = calls.feed(piece.text)
    return Piece(content, piece.tokens, piece.logprobs, fragments)


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run work; cancel it if the client disconnects first. Returns (completed, result)."""
    result: T | None = None
    error: BaseException | None = None
    completed = False
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            nonlocal result, completed, error
            try:
                result = await work()
                completed = True
            except Exception as exc:  # re-raised below, unwrapped from the task group
                error = exc
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if error is not None:
        raise error
    return completed, result
