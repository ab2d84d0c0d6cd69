"""Serving the generation endpoints: a request's jobs run on the engine, answered whole (JSON)
or as a stream (SSE), shaped by the endpoint's shaper, errors counted once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import Engine
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.openai.chat.shaper import ChatShaper
from inferencemesh.frontend.openai.choices import (
    ChoiceRun,
    ChoiceState,
    choice_pieces,
    close_iterator,
    close_runs,
    runs_usage,
    start_runs,
)
from inferencemesh.frontend.openai.completions.protocol import CompletionRequest
from inferencemesh.frontend.openai.completions.shaper import CompletionShaper
from inferencemesh.frontend.openai.errors import APIError, as_api_error, log_server_error
from inferencemesh.frontend.openai.jobs import Body, Job, JobBuilder
from inferencemesh.frontend.openai.logprobs import LogprobsFormatter
from inferencemesh.frontend.openai.responses.shaper import ResponsesShaper
from inferencemesh.frontend.openai.shaper import Shaper
from inferencemesh.frontend.openai.sse import SSE_KEEPALIVE_S, EventStream, merged, stop_tasks, with_keepalive

log = logging.getLogger("inferencemesh.frontend")

RETRY_AFTER_S = 1  # the Retry-After of a 429: queues drain in about a request's time

T = TypeVar("T")


class Serving:
    """The generation endpoints of one served model, and what the other routes ask of it."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, model: str,
                 metrics: FrontendMetrics, sse_keepalive_s: float = SSE_KEEPALIVE_S) -> None:
        self.engine, self.tokenizer, self.model, self.metrics = engine, tokenizer, model, metrics
        self.sse_keepalive_s = sse_keepalive_s
        self.created = int(time.time())
        self.jobs = JobBuilder(engine, tokenizer, model, metrics)
        self.vocab_size = self.jobs.vocab_size
        formatter = LogprobsFormatter(tokenizer)
        self.shapers: dict[str, Shaper] = {"chat": ChatShaper(formatter), "completion": CompletionShaper(formatter),
                                           "response": ResponsesShaper(formatter)}

    def error_response(self, err: APIError) -> JSONResponse:
        self._count_error(err)
        # Overload (a draining replica too) is temporary: tell clients (the openai client honours it)
        # when to come back.
        retry_after = err.retry_after if err.retry_after is not None else RETRY_AFTER_S if err.status == 429 else None
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _count_error(self, err: APIError, request_id: str | None = None) -> None:
        """Every request answered with an error, once: as a JSON error, or in-band in a stream."""
        self.metrics.request_errors.labels(self.model, str(err.status)).inc()
        log_server_error(err, request_id)

    def model_card(self) -> dict[str, Any]:
        try:
            described = self.engine.describe()
        except Exception:
            log.exception("engine.describe() failed")
            described = {}
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "inferencemesh",
                "max_model_len": self.engine.max_context, "inferencemesh": described}

    async def handle(self, request: Request, body: Body, *, shape: str | None = None,
                     request_id: str | None = None, echoed: Mapping[str, Any] | None = None) -> Response:
        """One response for a request's choices: n per prompt (completions may send several
        prompts), generated concurrently, choice index = prompt index * n + j. shape: the
        shaper to answer with (default: the body's endpoint); request_id: the response's id
        (default: one of the endpoint's form); echoed: the settings the answer reports (Job.echoed)."""
        arrival = getattr(request.state, "arrival", time.perf_counter())
        prompts = body.prompts() if isinstance(body, CompletionRequest) else [None]
        jobs = [await self.jobs.job(body, arrival, prompt) for prompt in prompts]
        jobs = [replace(job, id=request_id or jobs[0].id, created=jobs[0].created, index=i,
                        kind=shape or job.kind, echoed=echoed or {}) for i, job in enumerate(jobs)]
        if jobs[0].stream:
            return await self._start_stream(jobs, body.n or 1)
        runs = await start_runs(self.engine, self.metrics, jobs, body.n or 1)
        try:
            completed, result = await until_disconnect(request, lambda: self._complete(runs))
        finally:
            await close_runs(runs)  # also when _complete() never started (a cancelled task)
        if not completed:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(result)

    # --- a whole response ---

    async def _complete(self, runs: list[ChoiceRun]) -> dict[str, Any]:
        """The whole response: the choices generated concurrently; the first failure fails it
        (the others are cancelled; the caller releases their sessions)."""
        tasks = [asyncio.ensure_future(self._choice(run)) for run in runs]
        try:
            choices = list(await asyncio.gather(*tasks))
        finally:
            await stop_tasks(tasks)
        return self.shapers[runs[0].job.kind].response(runs, choices, runs_usage(runs))

    async def _choice(self, run: ChoiceRun) -> dict[str, Any]:
        try:
            generated = [piece async for piece in choice_pieces(run, self.tokenizer)]
        except Exception as exc:
            run.tracker.finish("error")
            raise as_api_error(exc) from exc
        finally:
            await close_iterator(run.iterator)
        _finished(run)
        return self.shapers[run.job.kind].choice(run, generated)

    # --- a stream ---

    async def _start_stream(self, jobs: list[Job], n: int) -> Response:
        """A stream's response. A start within the keep-alive interval answers as a non-streamed
        request does (a 429 is a 429); a start that takes longer (a stalled stage) sends the
        headers and keep-alive comments while it waits, and a failure to start goes in-band."""
        starting = asyncio.ensure_future(start_runs(self.engine, self.metrics, jobs, n))
        try:
            done, _ = await asyncio.wait({starting}, timeout=self.sse_keepalive_s)
        except BaseException:
            await _abandon(starting)
            raise
        body: AsyncIterator[str]
        if done:
            runs = starting.result()
            body, on_close = self._stream(runs), partial(close_runs, runs)
        else:
            body, on_close = self._late_stream(starting, jobs[0]), partial(_abandon, starting)
        return EventStream(with_keepalive(body, self.sse_keepalive_s), on_close=on_close,
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _late_stream(self, starting: asyncio.Future[list[ChoiceRun]], job: Job) -> AsyncIterator[str]:
        runs: list[ChoiceRun] | None = None
        try:
            runs = await starting
        except Exception as exc:  # headers are sent: report in-band, as _stream() does
            for event in self._in_band(exc, job, ChoiceState()):
                yield event
            return
        finally:
            if runs is None:  # the client left while the engine was starting
                await _abandon(starting)
        chunks = self._stream(runs)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            try:
                await chunks.aclose()
            finally:
                await close_runs(runs)  # a stream closed before its first chunk never ran its own finally

    async def _stream(self, runs: list[ChoiceRun]) -> AsyncGenerator[str, None]:
        """The SSE body: every choice's chunks as they come (each carries its index), then usage
        (when asked) and [DONE], as the shaper ends a stream. A failure is reported in-band: the
        headers are sent already."""
        first = runs[0].job
        chunks = merged([self._choice_chunks(run) for run in runs])
        try:
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as exc:  # headers are sent: report in-band, as OpenAI does
                for event in self._in_band(exc, first, runs[0].state):
                    yield event
                return
            for event in self.shapers[first.kind].stream_end(runs, runs_usage(runs)):
                yield event
        finally:
            try:
                await chunks.aclose()
            finally:
                await close_runs(runs)

    def _in_band(self, exc: Exception, job: Job, state: ChoiceState) -> list[str]:
        """A failure after the headers went out: the error as an event, then the end."""
        err = as_api_error(exc)
        self._count_error(err, job.id)
        return self.shapers[job.kind].stream_error(job, state, err.body())

    async def _choice_chunks(self, run: ChoiceRun) -> AsyncIterator[str]:
        job, state, shaper = run.job, run.state, self.shapers[run.job.kind]
        for opening in shaper.opening(run):
            yield shaper.chunk(job, state, opening)
        try:
            async for piece in choice_pieces(run, self.tokenizer):
                yield shaper.chunk(job, state, shaper.delta(run, piece))
        except Exception:
            run.tracker.finish("error")
            raise
        yield shaper.chunk(job, state, shaper.closing(run))
        _finished(run)


def _finished(run: ChoiceRun) -> None:
    """A choice's metrics, once its pieces have all been read (choice_pieces set why it ended)."""
    assert run.state.finish_reason is not None
    run.tracker.finish(run.state.finish_reason)


async def _abandon(starting: asyncio.Future[list[ChoiceRun]]) -> None:
    """A start nobody will stream any more: cancelled (start_runs then closes what it started), or,
    when it finished in the very loop iteration its caller was cancelled, its runs closed here."""
    await stop_tasks([starting])
    if starting.done() and not starting.cancelled() and starting.exception() is None:
        await close_runs(starting.result())


def serving(request: Request) -> Serving:
    """The Serving of the app a route's request came to (create_app sets it)."""
    front = request.app.state.frontend
    assert isinstance(front, Serving)
    return front


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
