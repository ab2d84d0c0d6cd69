"""The frontend's step scheduler: how waiting frames become microbatches (its pure rule), and the
class itself over a stream: its in-flight limit, a broken stream, and either of its tasks dying."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest

from inferencemesh.frontend.engine.scheduler import ScheduledSession, StepScheduler, next_microbatch
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.protocol.transport import expects_ack, expects_prediction


def waiting(session: str, kind: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(frame=pb.Frame(session_id=session, kind=kind, token_count=tokens))


def names(items: list) -> list[str]:
    return [f"{i.frame.session_id}:{pb.FrameKind.Name(i.frame.kind)}" for i in items]


def test_decodes_always_ride_prompt_chunks_share_a_budget_and_a_session_waits_its_turn() -> None:
    queue = [waiting("a", pb.DECODE, 1),
             waiting("p", pb.PREFILL, 6),   # the first chunk always goes, whatever its size
             waiting("q", pb.PREFILL, 3),   # 6 + 3 > budget 8: waits
             waiting("a", pb.DECODE, 1),    # a is in this batch already: next one
             waiting("v", pb.VERIFY, 5),    # decode and verify frames never wait for the budget
             waiting("r", pb.PREFILL, 2),   # 6 + 2 fits
             waiting("q", pb.PREFILL, 1),   # q's earlier chunk waits, so this one does too
             waiting("p", pb.RELEASE, 0)]
    batch, rest = next_microbatch(queue, budget=8)
    assert names(batch) == ["a:DECODE", "p:PREFILL", "v:VERIFY", "r:PREFILL"]
    assert names(rest) == ["q:PREFILL", "a:DECODE", "q:PREFILL", "p:RELEASE"]
    batch, rest = next_microbatch(rest, budget=8)
    assert names(batch) == ["q:PREFILL", "a:DECODE", "p:RELEASE"] and names(rest) == ["q:PREFILL"]
    assert next_microbatch([], budget=8) == ([], [])


# ---- the class: one stream, its two tasks, its in-flight limit ----------------------------------


class ScriptedStage:
    """A BatchStream (inferencemesh.protocol.streams) that answers as a last stage does: a Prediction
    for each frame that wants one, an Ack for each RELEASE and each prompt chunk that wants none.
    While `holding`, answers wait (batches pile up in flight); end() ends the stream, with a status
    or cleanly."""

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency  # seconds before a batch is answered (0: at once), as a pipeline's
        self.sent: list[pb.Batch] = []
        self.held: list[pb.Batch] = []
        self.holding = False
        self.in_flight = self.most_in_flight = 0
        self.ended = self.cancelled = False
        self._results: asyncio.Queue = asyncio.Queue()

    async def send(self, batch: pb.Batch) -> None:
        if self.ended:
            raise PipelineError(grpc.StatusCode.UNAVAILABLE, "the stream has ended")
        self.sent.append(batch)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.holding:
            self.held.append(batch)
        elif self.latency:
            asyncio.get_running_loop().call_later(self.latency, self.answer, batch)
        else:
            self.answer(batch)

    def answer(self, batch: pb.Batch) -> None:
        self.in_flight -= 1
        result = pb.BatchResult(seq=batch.seq)
        for frame in batch.frames:
            if expects_ack(frame):
                result.acks.add(seq=frame.seq, session_id=frame.session_id, kind=frame.kind)
            elif expects_prediction(frame):
                result.predictions.add(session_id=frame.session_id, seq=frame.seq, tokens=[7])
        self._results.put_nowait(result)

    def release(self) -> None:
        self.holding = False
        held, self.held = self.held, []
        for batch in held:
            self.answer(batch)

    def end(self, error: BaseException | None = None) -> None:
        self.ended = True
        self._results.put_nowait(error)

    async def results(self) -> AsyncIterator[pb.BatchResult]:
        while True:
            item = await self._results.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def finish(self) -> None:
        self.end()

    def cancel(self) -> None:
        self.cancelled = True


def chunk(session: str, seq: int, want: bool = False) -> pb.Frame:
    return pb.Frame(session_id=session, seq=seq, kind=pb.PREFILL, pos_start=seq, token_count=1, token_ids=[1],
                    want_prediction=want)


def test_no_more_microbatches_in_flight_than_the_limit_and_each_sessions_frames_in_order() -> None:
    async def go() -> ScriptedStage:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        session = ScheduledSession(scheduler, "a", step_timeout=5)
        stage.holding = True
        # prompt chunks that want no prediction: sent without waiting for their Acks, one per batch
        acks = [session.submit(chunk("a", seq)) for seq in range(1, 6)]
        await asyncio.sleep(0.05)
        assert [len(b.frames) for b in stage.sent] == [1, 1] and stage.in_flight == 2
        assert not any(ack.done() for ack in acks)
        stage.release()
        last = await session.send(chunk("a", 6, want=True))
        assert list(last.tokens) == [7]
        assert [ack.result() for ack in acks] == [None] * 5  # each acknowledged
        await scheduler.close()
        return stage

    stage = asyncio.run(go())
    assert stage.most_in_flight == 2
    assert [f.seq for b in stage.sent for f in b.frames] == [1, 2, 3, 4, 5, 6]
    assert stage.cancelled


def test_sessions_decoding_together_are_shared_among_the_stages_microbatches() -> None:
    """8 sessions whose frames all wait at once, 2 stages: two microbatches of 4, not one of 8, and
    they stay apart step after step (sent as one, the sessions would come back together and go out
    together again: one stage computing at a time). The pure rule's `most` caps a microbatch."""
    assert names(next_microbatch([waiting(s, pb.DECODE, 1) for s in "abcde"], 8, most=3)[0]) == \
        ["a:DECODE", "b:DECODE", "c:DECODE"]

    async def go() -> list[list[str]]:
        stage = ScriptedStage(latency=0.01)
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        sessions = [ScheduledSession(scheduler, f"s{i}", step_timeout=5) for i in range(8)]

        async def decode(session: ScheduledSession) -> None:
            for step in range(4):
                await session.send(pb.Frame(session_id=session.session_id, seq=step + 1, kind=pb.DECODE,
                                            pos_start=step, token_count=1, token_ids=[1]))

        await asyncio.gather(*(decode(s) for s in sessions))
        await scheduler.close()
        return [sorted(f.session_id for f in b.frames) for b in stage.sent]

    batches = asyncio.run(go())
    assert [len(b) for b in batches] == [4] * 8, batches
    assert len({tuple(b) for b in batches}) == 2  # the same two groups every step


def test_a_broken_stream_fails_its_sessions_at_once_with_the_stages_status() -> None:
    async def go() -> None:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        session = ScheduledSession(scheduler, "a", step_timeout=30)
        stage.holding = True
        waiting = asyncio.create_task(session.send(chunk("a", 1, want=True)))
        await asyncio.sleep(0.05)
        stage.end(PipelineError(grpc.StatusCode.UNAVAILABLE, "stage 1 went away"))
        with pytest.raises(PipelineError, match="stage 1 went away") as lost:
            await asyncio.wait_for(waiting, 2)
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE and scheduler.failure is lost.value
        with pytest.raises(PipelineError):  # and nothing more goes out on it
            await ScheduledSession(scheduler, "b", step_timeout=30).send(chunk("b", 1, want=True))

    asyncio.run(go())


class _Bug(Exception):
    pass


class BrokenSender(ScriptedStage):
    async def send(self, batch: pb.Batch) -> None:
        raise _Bug("a bug in the send path")


@pytest.mark.parametrize("task", ["reader", "sender"])
def test_a_scheduler_task_that_dies_fails_the_waiting_sessions_at_once_and_says_so(
        task: str, caplog: pytest.LogCaptureFixture) -> None:
    """Not after the 30 s step timeout, and not silently."""
    async def go() -> PipelineError:
        stage = BrokenSender() if task == "sender" else ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        session = ScheduledSession(scheduler, "a", step_timeout=30)
        stage.holding = True
        waiting = asyncio.create_task(session.send(chunk("a", 1, want=True)))
        await asyncio.sleep(0.05)
        if task == "reader":
            stage.end(_Bug("a bug in the read path"))
        with pytest.raises(PipelineError) as lost:
            await asyncio.wait_for(waiting, 2)
        return lost.value

    with caplog.at_level(logging.ERROR, logger="inferencemesh.frontend.engine.scheduler"):
        err = asyncio.run(go())
    assert err.code == grpc.StatusCode.INTERNAL and f"step-scheduler-{task}" in str(err) and "_Bug" in str(err)
    assert any(f"step-scheduler-{task} ended unexpectedly" in r.getMessage() for r in caplog.records)


# ---- cancellation: a cancelled session's send is cancelled, whenever its answer comes ----------


async def _in_flight(scheduler: StepScheduler, stage: ScriptedStage, frame: pb.Frame) -> tuple[asyncio.Task, object]:
    """A send of `frame` on its way (the stage holds its batch): the send's task, and the frame's
    place in the scheduler (whose `answer` future the send awaits)."""
    session = ScheduledSession(scheduler, frame.session_id, step_timeout=30)
    stage.holding = True
    task = asyncio.create_task(session.send(frame))
    while not scheduler.in_flight:
        await asyncio.sleep(0)
    (waiting,) = next(iter(scheduler.in_flight.values()))
    return task, waiting


@pytest.mark.parametrize("order", ["answer, then cancel", "cancel, then answer"])
def test_a_send_cancelled_in_the_loop_iteration_its_answer_arrives_is_cancelled(order: str) -> None:
    """asyncio.wait_for (Python 3.11) returned the answer here and dropped the cancel: a cancelled
    stream's pump went on, blocked on a queue nobody read, and its slot never came back."""
    async def go() -> None:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        task, waiting = await _in_flight(scheduler, stage, chunk("a", 1, want=True))
        result = pb.BatchResult(seq=1)
        result.predictions.add(session_id="a", seq=1, tokens=[7])
        # Both in one loop iteration, with no await between, as the stream's reader answering a
        # batch (what it does with each result) and a client's disconnect can come.
        if order == "answer, then cancel":
            StepScheduler._answer([waiting], result)
            task.cancel()
        else:
            task.cancel()
            StepScheduler._answer([waiting], result)
        with pytest.raises(asyncio.CancelledError):
            await task
        await scheduler.close()

    for _ in range(20):  # deterministic: every time, not most times
        asyncio.run(go())


def test_a_send_still_times_out_as_a_stalled_stage_and_a_release_is_given_up_on_in_time() -> None:
    async def go() -> None:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        session = ScheduledSession(scheduler, "a", step_timeout=0.05)
        stage.holding = True
        with pytest.raises(PipelineError, match="no prediction within") as stalled:
            await session.send(chunk("a", 1, want=True))
        assert stalled.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        session.step_timeout = 30  # the release's own timeout (RELEASE_ACK_TIMEOUT_S) bounds it
        closing = asyncio.create_task(session.close())
        await asyncio.sleep(0.05)
        assert not closing.done()
        stage.release()
        assert await asyncio.wait_for(closing, 2) is True
        await scheduler.close()

    asyncio.run(go())


def test_a_withdrawn_session_sends_nothing_more_but_its_frames_in_flight_are_answered() -> None:
    """Preemption and close: frames not yet sent never go (their KV blocks may be another
    session's by then), and fail; one already in flight is answered, before any later frame."""
    async def go() -> None:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=1, token_budget=64)
        a, b = ScheduledSession(scheduler, "a", step_timeout=5), ScheduledSession(scheduler, "b", step_timeout=5)
        stage.holding = True
        sent, queued = a.submit(chunk("a", 1)), a.submit(chunk("a", 2))
        await asyncio.sleep(0.05)
        a.withdraw(PipelineError(grpc.StatusCode.ABORTED, "preempted"))
        with pytest.raises(PipelineError, match="preempted"):
            await queued
        with pytest.raises(PipelineError, match="preempted"):
            a.submit(chunk("a", 3))
        other = b.submit(chunk("b", 1, want=True))
        stage.release()
        assert await sent is None and list((await other).tokens) == [7]
        assert [(f.session_id, f.seq) for batch in stage.sent for f in batch.frames] == [("a", 1), ("b", 1)]
        await scheduler.close()

    asyncio.run(go())


def test_a_failed_chunk_fails_every_answer_its_session_awaits() -> None:
    async def go() -> None:
        stage = ScriptedStage()
        scheduler = StepScheduler(stage, in_flight_limit=2, token_budget=64)
        session = ScheduledSession(scheduler, "a", step_timeout=5)
        stage.holding = True
        first, last = session.submit(chunk("a", 1)), session.submit(chunk("a", 2, want=True))
        await asyncio.sleep(0.05)
        failing = pb.BatchResult(seq=stage.held[0].seq)
        failing.failures.add(session_id="a", seq=1, code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                             message="block 3 was never written")
        stage._results.put_nowait(failing)
        for answer in (first, last):
            with pytest.raises(PipelineError, match="never written") as failed:
                await answer
            assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await scheduler.close()

    asyncio.run(go())
