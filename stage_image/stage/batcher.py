"""Continuous batching on a stage: frames of different sessions that are waiting when the
device becomes free run together as one forward pass.

Decoding reads every weight of the stage once per pass however many tokens the pass holds,
so sessions decoding together cost little more than one alone. A frame never waits for
company: when the device is idle a frame runs at once, by itself; the frames that arrive
while a pass runs are taken together by the next pass. Prompt (PREFILL) frames run alone (the
frontend already cuts them into chunks); DECODE and VERIFY frames share a pass up to
`max_tokens` tokens, and a session never has two frames in one pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from inferencemesh.config import DEFAULT_MAX_BATCH_TOKENS
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import StageSession


@dataclass
class _Job:
    session: StageSession
    frame: pb.Frame
    inputs: torch.Tensor
    future: asyncio.Future
    queued: float  # time.perf_counter() when submitted


class Batcher:
    """Queues frames and runs them on the executor, as many per pass as may go together."""

    def __init__(self, compute_batch: Callable[[list], list], executor: Executor,
                 max_tokens: int = DEFAULT_MAX_BATCH_TOKENS, metrics: StageMetrics | None = None) -> None:
        self.compute_batch = compute_batch
        self.metrics = metrics
        self.executor = executor
        self.max_tokens = max_tokens
        self._pending: list[_Job] = []
        self._draining = False

    async def submit(self, session: StageSession, frame: pb.Frame, inputs: torch.Tensor):
        """The frame's result once its pass has run (a Fault for this frame alone is raised)."""
        job = _Job(session, frame, inputs, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._pending.append(job)
        if not self._draining:
            self._draining = True
            asyncio.create_task(self._drain())
        return await job.future

    def _take(self) -> list[_Job]:
        first = self._pending.pop(0)
        if first.frame.kind == pb.PREFILL:
            return [first]
        batch, tokens, rest = [first], first.frame.token_count, []
        sessions = {first.session.session_id}
        for job in self._pending:
            fits = tokens + job.frame.token_count <= self.max_tokens
            if job.frame.kind != pb.PREFILL and fits and job.session.session_id not in sessions:
                batch.append(job)
                tokens += job.frame.token_count
                sessions.add(job.session.session_id)
            else:
                rest.append(job)
        self._pending = rest
        return batch

    def _run(self, batch: list[_Job]) -> list:
        """One pass, on the compute thread; timed there, so event-loop delays count as neither."""
        started = time.perf_counter()
        try:
            return self.compute_batch([(j.session, j.frame, j.inputs) for j in batch])
        finally:
            if self.metrics is not None:
                for job in batch:
                    self.metrics.queue_wait.observe(started - job.queued)
                self.metrics.observe_pass(time.perf_counter() - started)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = [job for job in self._take() if not job.future.done()]  # drop abandoned frames
                if not batch:
                    continue
                try:
                    results = await loop.run_in_executor(self.executor, self._run, batch)
                except Exception as err:  # the pass itself failed: every frame in it gets the error
                    results = [err] * len(batch)
                for job, result in zip(batch, results, strict=True):
                    if job.future.done():
                        continue
                    if isinstance(result, BaseException):
                        job.future.set_exception(result)
                    else:
                        job.future.set_result(result)
        finally:
            self._draining = False
