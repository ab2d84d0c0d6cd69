"""Where a stage's device work runs, and how one forward pass over a batch's frames is run.

Device work runs where the stage's executor says: on a stage process's main thread
(programs.stage's MainThreadExecutor), or inline on the event loop's thread for a stage inside
another process (InlineExecutor): one computing thread per process, one OpenMP team.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import grpc

from inferencemesh.protocol.errors import Fault
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.worker import Job, StageWorker

log = logging.getLogger("inferencemesh.stage")


class InlineExecutor(Executor):
    """Runs submitted work at once, on the submitting thread (here: the event loop's)."""

    inline = True  # ComputeLane calls such work directly instead of awaiting a future

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # delivered to the awaiting coroutine
            future.set_exception(err)
        return future


class ComputeLane:
    """A stage's one computing thread: device work goes there, and a batch's forward pass is timed there."""

    def __init__(self, executor: Executor, metrics: StageMetrics, stage_index: int) -> None:
        self.executor = executor
        self.metrics = metrics
        self.stage_index = stage_index

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) where this stage computes. A stage inside another process computes inline, on
        the event loop's own thread (InlineExecutor): called directly, without a future's wake-up."""
        if getattr(self.executor, "inline", False):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def forward(self, worker: StageWorker, jobs: list[Job]) -> list:
        """One forward pass over the jobs, on the compute thread; per job its output or Fault."""
        if not jobs:
            return []
        queued = time.perf_counter()

        def run() -> list:  # timed on the compute thread: event-loop delays count as neither
            started = time.perf_counter()
            try:
                return worker.compute_batch(jobs)
            finally:
                for _ in jobs:
                    self.metrics.queue_wait.observe(started - queued)
                self.metrics.observe_pass(time.perf_counter() - started)

        try:
            return await self.run(run)
        except Fault as fault:
            return [fault] * len(jobs)
        except Exception as err:
            if len(jobs) > 1:
                # The frames were checked before the pass, yet it failed: compute each alone, so
                # that only the frame that makes it fail fails (pos_start is authoritative: a
                # frame computed again overwrites what the failed pass left in its cache).
                log.warning("stage %d: a pass of %d frames failed (%s: %s); computing them one by one",
                            self.stage_index, len(jobs), type(err).__name__, err)
                return [out for job in jobs for out in await self.forward(worker, [job])]
            log.exception("stage %d: a forward pass failed", self.stage_index)
            return [Fault(grpc.StatusCode.INTERNAL, f"forward pass failed: {type(err).__name__}: {err}")]

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
