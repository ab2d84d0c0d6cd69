"""The frontend's view of the stages: open a session, send frames, await predictions.

GrpcPipeline talks to stage servers: frames go into stage 0's Session stream, predictions
come from the last stage's Results stream. Stage 0 may be embedded in this process
(inferencemesh.stage.embedded): it is then reached through a local stub of the same shape.
inferencemesh.stage.inprocess.LocalPipeline runs the stages' own workers in one process with
the same interface (benchmarks, tests); the engine cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.protocol.transport import GRPC_OPTIONS, RELEASE_ACK_TIMEOUT_S, expects_ack, expects_prediction
from inferencemesh.tls import TlsMaterial, aio_channel

if TYPE_CHECKING:
    from inferencemesh.stage.embedded import EmbeddedStage


class PipelineSession(Protocol):
    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        """Send one frame; return its Prediction when the frame asks for one. A FORK returns
        (None) once every stage holds the new session."""
        ...

    async def close(self) -> None: ...


class GrpcSession:
    """One request's two streams: frames into stage 0, predictions out of the last stage."""

    def __init__(self, first: pb_grpc.StageStub, last: pb_grpc.StageStub, session_id: str, step_timeout: float):
        self.session_id = session_id
        self.step_timeout = step_timeout
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._results = last.Results(pb.ResultsRequest(session_id=session_id))
        self._frames = first.Session()
        self._released = asyncio.Event()  # stage 0 acknowledged RELEASE: every stage has let go
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
            async for ack in self._frames:  # stages acknowledge only RELEASE and FORK
                if ack.kind == pb.FORK:
                    self._inbox.put_nowait(ack)
                else:
                    self._released.set()
        except grpc.aio.AioRpcError as err:
            self._inbox.put_nowait(PipelineError(err.code(), err.details() or str(err.code())))
        finally:
            self._released.set()

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        try:
            await self._frames.write(frame)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            # the stream already ended: its reader has queued the stage's status, prefer that
            raise self._ended_with(err) from err
        wants_ack = expects_ack(frame)
        if not wants_ack and not expects_prediction(frame):
            return None
        while True:
            try:
                item = await asyncio.wait_for(self._inbox.get(), self.step_timeout)
            except asyncio.TimeoutError as err:
                raise PipelineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no prediction within {self.step_timeout:.1f}s: a stage is stalled") from err
            if isinstance(item, PipelineError):
                raise item
            if item.seq == frame.seq and isinstance(item, pb.Ack) == wants_ack:
                return None if wants_ack else item
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
        # Wait for the acknowledgement: it comes once every stage has freed the session, so the
        # request's slot is really free when the engine hands it to the next request.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._frames.write(pb.Frame(session_id=self.session_id, kind=pb.RELEASE)), 1.0)
            await asyncio.wait_for(self._released.wait(), RELEASE_ACK_TIMEOUT_S)
            await self._frames.done_writing()
        for task in self._tasks:
            task.cancel()
        self._results.cancel()
        self._frames.cancel()


class GrpcPipeline:
    """The stage processes at `addresses`, in pipeline order, after the embedded first stage if any."""

    def __init__(self, addresses: list[str], *, step_timeout: float = 30.0, tls: TlsMaterial | None = None,
                 embedded: EmbeddedStage | None = None) -> None:
        if not addresses and embedded is None:
            raise ValueError("a pipeline needs at least one stage address")
        self.addresses = addresses
        self.step_timeout = step_timeout
        self.tls = tls
        self.embedded = embedded
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list = []

    def connect(self) -> None:
        """Channels belong to the event loop that makes them: make them on first use (or call this
        on the serving loop at start-up: an embedded first stage then begins loading its layers)."""
        if not self._stubs:
            self._channels = [aio_channel(a, self.tls, GRPC_OPTIONS) for a in self.addresses]
            self._stubs = [pb_grpc.StageStub(c) for c in self._channels]
            self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
            if self.embedded is not None:
                stage, health = self.embedded.stubs()
                self._stubs.insert(0, stage)
                self._health.insert(0, health)

    def open(self) -> GrpcSession:
        self.connect()
        return GrpcSession(self._stubs[0], self._stubs[-1], uuid.uuid4().hex, self.step_timeout)

    async def is_ready(self, timeout: float = 3.0) -> bool:
        """True when every stage's grpc.health.v1 says SERVING."""
        self.connect()
        async def serving(stub: health_pb2_grpc.HealthStub) -> bool:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        return all(await asyncio.gather(*(serving(h) for h in self._health)))

    async def infos(self, timeout: float = 2.0) -> list[pb.StageInfo]:
        self.connect()
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
        self._channels, self._stubs = [], []
        if self.embedded is not None:
            await self.embedded.close()
