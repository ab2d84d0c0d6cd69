"""The frontend's view of the stages: open a session, send frames, await predictions.

GrpcPipeline talks to stage servers: frames go into stage 0's Session stream, predictions
come from the last stage's Results stream. LocalPipeline runs the same StageWorkers in this
process with no network (benchmarks, tests, single-process serving); the engine cannot
tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inferencemesh.stage.server import GRPC_OPTIONS
from inferencemesh.stage.sessions import StageSession
from inferencemesh.stage.worker import Fault, StageWorker

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.tls import TlsMaterial, aio_channel


class PipelineError(Exception):
    """A stage refused a frame or went away; `code` is the gRPC status, `retryable` whether
    re-prefilling the session may succeed (a restarted or briefly unreachable stage)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class PipelineSession(Protocol):
    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        """Send one frame; return its Prediction when the frame asks for one."""
        ...

    async def close(self) -> None: ...


def expects_prediction(frame: pb.Frame) -> bool:
    return frame.kind in (pb.DECODE, pb.VERIFY) or (frame.kind == pb.PREFILL and frame.want_prediction)


class GrpcSession:
    """One request's two streams: frames into stage 0, predictions out of the last stage."""

    def __init__(self, first: pb_grpc.StageStub, last: pb_grpc.StageStub, session_id: str, step_timeout: float):
        self.session_id = session_id
        self.step_timeout = step_timeout
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._results = last.Results(pb.ResultsRequest(session_id=session_id))
        self._frames = first.Session()
        self._tasks = [asyncio.create_task(self._read_results()), asyncio.create_task(self._watch_frames())]
        self._closed = False

    async def _read_results(self) -> None:
        try:
            async for prediction in self._results:
                self._inbox.put_nowait(prediction)
            self._inbox.put_nowait(PipelineError(grpc.StatusCode.UNAVAILABLE, "the last stage ended the session"))
        except grpc.aio.AioRpcError as err:
            self._inbox.put_nowait(PipelineError(err.code(), err.details() or str(err.code())))

    async def _watch_frames(self) -> None:
        try:
            async for _ack in self._frames:
                pass
        except grpc.aio.AioRpcError as err:
            self._inbox.put_nowait(PipelineError(err.code(), err.details() or str(err.code())))

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        try:
            await self._frames.write(frame)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            # the stream already ended: its reader has queued the stage's status, prefer that
            raise self._ended_with(err) from err
        if not expects_prediction(frame):
            return None
        while True:
            try:
                item = await asyncio.wait_for(self._inbox.get(), self.step_timeout)
            except asyncio.TimeoutError as err:
                raise PipelineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no prediction within {self.step_timeout:.1f}s: a stage is stalled") from err
            if isinstance(item, PipelineError):
                raise item
            if item.seq == frame.seq:
                return item
            # a late answer to an earlier, abandoned frame: skip it

    def _ended_with(self, err: Exception) -> PipelineError:
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, PipelineError):
                return item
        return PipelineError(grpc.StatusCode.UNAVAILABLE, f"stage 0 stream ended: {err}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._frames.write(pb.Frame(session_id=self.session_id, kind=pb.RELEASE)), 1.0)
            await self._frames.done_writing()
        for task in self._tasks:
            task.cancel()
        self._results.cancel()
        self._frames.cancel()


class GrpcPipeline:
    def __init__(self, addresses: list[str], *, step_timeout: float = 30.0, tls: TlsMaterial | None = None) -> None:
        if not addresses:
            raise ValueError("a pipeline needs at least one stage address")
        self.addresses = addresses
        self.step_timeout = step_timeout
        self.tls = tls
        self._channels: list[grpc.aio.Channel] = []

    def _connect(self) -> None:
        """Channels belong to the event loop that makes them: make them on first use."""
        if not self._channels:
            self._channels = [aio_channel(a, self.tls, GRPC_OPTIONS) for a in self.addresses]
            self._stubs = [pb_grpc.StageStub(c) for c in self._channels]
            self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]

    def open(self) -> GrpcSession:
        self._connect()
        return GrpcSession(self._stubs[0], self._stubs[-1], uuid.uuid4().hex, self.step_timeout)

    async def is_ready(self, timeout: float = 3.0) -> bool:
        """True when every stage's grpc.health.v1 says SERVING."""
        self._connect()
        async def serving(stub: health_pb2_grpc.HealthStub) -> bool:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        return all(await asyncio.gather(*(serving(h) for h in self._health)))

    async def infos(self, timeout: float = 2.0) -> list[pb.StageInfo]:
        self._connect()
        return list(await asyncio.gather(*(s.Info(pb.InfoRequest(), timeout=timeout) for s in self._stubs)))

    async def wait_ready(self, deadline_s: float) -> bool:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if await self.is_ready():
                return True
            await asyncio.sleep(0.2)
        return False

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels = []


class LocalSession:
    def __init__(self, pipeline: LocalPipeline, session_id: str) -> None:
        self.pipeline = pipeline
        self.session_id = session_id
        self.states = [StageSession(session_id) for _ in pipeline.workers]

    def _run(self, frame: pb.Frame) -> pb.Prediction | None:
        workers = self.pipeline.workers
        try:
            x = workers[0].inputs(frame)
            for worker, state in zip(workers, self.states, strict=True):
                x = worker.compute(state, frame, x)
        except Fault as fault:
            raise PipelineError(fault.code, fault.message) from fault
        return x

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        return self._run(frame)  # on the event loop's own thread: see LocalPipeline

    async def close(self) -> None:
        for state in self.states:
            if state.kv is not None:
                state.kv.release()
                state.kv = None


class LocalPipeline:
    """All stages in this process: frames pass from worker to worker as tensors.

    It computes on the calling (event-loop) thread, blocking it: in one process there is
    nothing else to serve meanwhile, and one computing thread means one OpenMP team (see
    stage.server.MainThreadExecutor).
    """

    computes_inline = True

    def __init__(self, runtimes: list) -> None:
        last = len(runtimes) - 1
        self.workers = [StageWorker(rt, is_first=i == 0, is_last=i == last) for i, rt in enumerate(runtimes)]

    def open(self) -> LocalSession:
        return LocalSession(self, uuid.uuid4().hex)

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass
