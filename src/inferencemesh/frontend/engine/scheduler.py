"""The step scheduler: every session's frames, in microbatches, over one stream into stage 0.

Sessions submit their next frame (a prompt chunk, a decode token, a verify window) when they
have it. Whenever fewer microbatches than there are stages are in flight, the frames waiting go
out as Batches, shared evenly among the free places: each stage computes a Batch in one forward
pass, and with one microbatch in flight per stage, every stage has one to work on. The last stage's BatchResult
for it comes back up the same stream. What carries the stream (gRPC, or a stage in this
process) is the hop's business (hops.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.protocol.streams import BatchStream
from inferencemesh.protocol.transport import (
    MAX_DRAFT_ROWS_PER_BATCH,
    RELEASE_ACK_TIMEOUT_S,
    expects_ack,
    expects_prediction,
)

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.metrics import FrontendMetrics

log = logging.getLogger("inferencemesh.frontend.engine.scheduler")

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class _Waiting:
    """A frame on its way: waiting for a microbatch, then in flight in one."""

    frame: pb.Frame
    session: ScheduledSession
    answer: asyncio.Future | None  # its Prediction (or None, for an acknowledged frame); None: no answer


def draft_rows(frame: pb.Frame) -> int:
    """Draft distributions the frame carries, one a draft (a sampled VERIFY of a draft model's window)."""
    return frame.token_count - 1 if frame.kind == pb.VERIFY and frame.HasField("draft_q") else 0


def _within(used: int, more: int, limit: int) -> bool:
    """Whether `more` fits beside `used` under `limit`; the first always fits."""
    return not more or not used or used + more <= limit


def next_microbatch(waiting: list[_Waiting], budget: int, most: int | None = None
                    ) -> tuple[list[_Waiting], list[_Waiting]]:
    """(the next microbatch, what keeps waiting), from the waiting frames in arrival order: at
    most one frame per session (its later frames wait their turn), every decode and verify frame
    (up to `most` frames in all), and prompt chunks while their tokens stay within the budget (the
    first chunk always goes): a long prompt shares its steps with the other sessions' decoding,
    and never stalls them. Verify windows with draft probabilities go while their rows stay within
    MAX_DRAFT_ROWS_PER_BATCH, so that a Batch stays within the message limit the plan gave the
    stages (transport.message_limit)."""
    batch: list[_Waiting] = []
    rest: list[_Waiting] = []
    prompt_tokens = rows = 0
    sessions: set[str] = set()  # sessions in this batch, or with an earlier frame left waiting
    for item in waiting:
        frame = item.frame
        chunk = frame.token_count if frame.kind == pb.PREFILL else 0
        fits = _within(prompt_tokens, chunk, budget) and _within(rows, draft_rows(frame), MAX_DRAFT_ROWS_PER_BATCH)
        if frame.session_id in sessions or not fits or (most is not None and len(batch) >= most):
            rest.append(item)
        else:
            batch.append(item)
            prompt_tokens += chunk
            rows += draft_rows(frame)
        sessions.add(frame.session_id)
    return batch, rest


class StepScheduler:
    """One long-lived stream into stage 0, and the step scheduler that feeds it."""

    def __init__(self, stream: BatchStream, in_flight_limit: int, token_budget: int,
                 metrics: FrontendMetrics | None = None) -> None:
        self.stream = stream
        self._sizes = self._in_flight = None
        if metrics is not None:
            self._sizes = metrics.microbatch_frames.labels(metrics.model)
            self._in_flight = metrics.microbatches_in_flight.labels(metrics.model)
        self.limit = max(1, in_flight_limit)
        self.budget = token_budget
        self.waiting: list[_Waiting] = []
        self.in_flight: dict[int, list[_Waiting]] = {}
        self.failure: PipelineError | None = None  # the stream broke: every session on it is lost
        self._seq = 0
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._send_batches(), name="step-scheduler-sender"),
                       asyncio.create_task(self._read_results(), name="step-scheduler-reader")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        """Either task ends only through _break (which cancels both) or with the stream: one that
        ends otherwise (a bug) would leave every session waiting out its step timeout with
        nothing said. It is logged, and the stream breaks: its sessions fail now and replay."""
        if task.cancelled() or self.failure is not None:
            return
        err = task.exception()
        log.error("the step scheduler's %s ended unexpectedly", task.get_name(), exc_info=err)
        self._break(PipelineError(grpc.StatusCode.INTERNAL, f"the step scheduler's {task.get_name()} ended "
                                  f"unexpectedly: {type(err).__name__ if err else 'returned'}: {err}"))

    def submit(self, waiting: _Waiting) -> None:
        if self.failure is not None:
            raise self.failure
        self.waiting.append(waiting)
        self._wake.set()

    async def _settled(self) -> None:
        """Let the sessions that a result just woke submit their next frames before a batch is
        cut: each runs until it waits again, within an event-loop turn or two."""
        count = -1
        while count != len(self.waiting):
            count = len(self.waiting)
            await asyncio.sleep(0)

    async def _send_batches(self) -> None:
        while True:
            while not (self.waiting and len(self.in_flight) < self.limit):
                self._wake.clear()
                await self._wake.wait()
            await self._settled()
            # With several stages free, the waiting frames are shared among that many microbatches
            # (sent one after another), so that every stage has one to compute: sent as one, the
            # sessions would come back together and go out together again, one stage computing at
            # a time for as long as they run.
            free = self.limit - len(self.in_flight)
            frames, self.waiting = next_microbatch(self.waiting, self.budget, most=-(-len(self.waiting) // free))
            if not frames:  # the stream broke meanwhile (_break took them)
                continue
            self._seq += 1
            self.in_flight[self._seq] = frames
            if self._sizes is not None and self._in_flight is not None:
                self._sizes.observe(len(frames))
                self._in_flight.set(len(self.in_flight))
            try:
                await self.stream.send(pb.Batch(seq=self._seq, frames=[w.frame for w in frames]))
            except PipelineError as err:  # the stream already ended: its reader reports the stage's status
                self._break(PipelineError(err.code, f"stage 0 stream ended: {err}"))
                return

    async def _read_results(self) -> None:
        try:
            async for result in self.stream.results():
                self._answer(self.in_flight.pop(result.seq, []), result)
                if self._in_flight is not None:
                    self._in_flight.set(len(self.in_flight))
                self._wake.set()
            ended = PipelineError(grpc.StatusCode.UNAVAILABLE, "stage 0 ended the stream")
        except PipelineError as err:
            ended = err
        self._break(ended)

    @staticmethod
    def _answer(frames: list[_Waiting], result: pb.BatchResult) -> None:
        predictions = {(p.session_id, p.seq): p for p in result.predictions}
        acks = {(a.session_id, a.seq) for a in result.acks}
        failures = {(f.session_id, f.seq): f for f in result.failures}
        for waiting in frames:
            key = (waiting.frame.session_id, waiting.frame.seq)
            failure = failures.get(key)
            if failure is not None:  # this frame alone failed: its session is lost, the others go on
                waiting.session.fail(PipelineError(_STATUS.get(failure.code, grpc.StatusCode.UNKNOWN),
                                                   f"stage {failure.stage_index}: {failure.message}"), waiting)
            elif waiting.answer is not None and not waiting.answer.done():
                acknowledged = expects_ack(waiting.frame)
                if key not in (acks if acknowledged else predictions):
                    waiting.session.fail(PipelineError(grpc.StatusCode.INTERNAL,
                                                       "the last stage answered the batch without this frame"), waiting)
                else:
                    waiting.answer.set_result(None if acknowledged else predictions[key])

    def _break(self, err: PipelineError) -> None:
        if self.failure is not None:
            return
        self.failure = err
        lost = [w for frames in self.in_flight.values() for w in frames] + self.waiting
        self.in_flight, self.waiting = {}, []
        if self._in_flight is not None:
            self._in_flight.set(0)
        for waiting in lost:
            waiting.session.fail(err, waiting)
        for task in self._tasks:
            task.cancel()
        self.stream.cancel()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.stream.finish()
        self._break(PipelineError(grpc.StatusCode.CANCELLED, "the pipeline was closed"))


class ScheduledSession:
    """One request's session: its frames go out in the scheduler's microbatches."""

    def __init__(self, scheduler: StepScheduler, session_id: str, step_timeout: float) -> None:
        self.scheduler = scheduler
        self.session_id = session_id
        self.step_timeout = step_timeout
        self.failure: PipelineError | None = None
        self._closed = False
        self._answers: list[asyncio.Future] = []  # this session's answers still to come

    def fail(self, err: PipelineError, waiting: _Waiting | None = None) -> None:
        """One of this session's frames failed: it, every answer it still awaits (a prompt's
        chunks are in flight together) and every later send fail with that error."""
        self.failure = self.failure or err
        for answer in self._answers:
            if not answer.done():
                answer.set_exception(err)
        self._answers = []

    def withdraw(self, err: PipelineError) -> None:
        """The session gives up (preempted, or closing): its frames not yet sent never go (their
        blocks may go to another session) and their answers fail with `err`, as does every later
        send. Frames in flight are answered: every stage computes them before any later frame."""
        mine = [w for w in self.scheduler.waiting if w.session is self]
        self.scheduler.waiting = [w for w in self.scheduler.waiting if w.session is not self]
        self.failure = self.failure or err
        for waiting in mine:
            if waiting.answer is not None and not waiting.answer.done():
                waiting.answer.set_exception(err)

    def submit(self, frame: pb.Frame) -> asyncio.Future | None:
        """Send one frame without waiting: the future of its answer (a Prediction, or None once an
        acknowledged frame is acknowledged), None when none comes. Prompt chunks go out this way,
        one after another, while their acknowledgements are on their way."""
        if self.failure is not None:
            raise self.failure
        wants_answer = expects_prediction(frame) or expects_ack(frame)
        answer = asyncio.get_running_loop().create_future() if wants_answer else None
        self.scheduler.submit(_Waiting(frame, self, answer))  # frames are built fresh per send: no copy
        if answer is not None:
            self._answers = [a for a in self._answers if not a.done()]
            self._answers.append(answer)
        return answer

    async def wait(self, answer: asyncio.Future) -> pb.Prediction | None:
        """A submitted frame's answer, within the step timeout."""
        # asyncio.timeout, never wait_for: on Python 3.11 wait_for returns the answer when it
        # arrives in the loop iteration that cancels the caller, and the cancel is lost (a
        # cancelled stream then went on generating, and held its slot for good).
        try:
            async with asyncio.timeout(self.step_timeout):
                return await answer
        except TimeoutError as err:
            raise PipelineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no prediction within {self.step_timeout:.1f}s: a stage is stalled") from err

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        """Send one frame and wait for its answer: its Prediction when the frame asks for one."""
        answer = self.submit(frame)
        return None if answer is None else await self.wait(answer)

    async def close(self) -> bool:
        """RELEASE, and wait for its acknowledgement: it comes once every stage has freed the
        session, so the request's slot is really free when the engine hands it on. Whether it came.
        Frames not yet sent are withdrawn first. (A broken stream needs none: the stages freed its
        sessions when it ended.)"""
        if self._closed or self.scheduler.failure is not None:
            return False
        self._closed = True
        self.withdraw(PipelineError(grpc.StatusCode.CANCELLED, "the session was closed"))
        self.failure = None  # a failed session is still released where it is held
        with contextlib.suppress(Exception):
            async with asyncio.timeout(RELEASE_ACK_TIMEOUT_S):
                await self.send(pb.Frame(session_id=self.session_id, kind=pb.RELEASE))
            return True
        return False
