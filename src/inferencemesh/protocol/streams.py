"""One Pipeline stream into a stage, whatever carries it, and a stage reached over gRPC.

A BatchStream is what both ends of the data path hold: the frontend's step scheduler holds one
into the first stage, and every stage but the last holds one per upstream stream into the next
stage. It is either a gRPC stream (GrpcBatchStream, here) or a stage in this process called
directly (inferencemesh.stage.local). Either way it speaks only protocol messages and
PipelineError: nothing above it needs to know which.

RemoteStage is a stage process at an address: the frontend's hop to it and a stage's link to
the next one are the same object.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from inferencemesh.protocol import health
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.protocol.transport import channel_options
from inferencemesh.tls import TlsMaterial, aio_channel


class BatchStream(Protocol):
    """An open Pipeline stream: batches in order, their BatchResults out in order."""

    async def send(self, batch: pb.Batch) -> None:
        """Send one batch; PipelineError(UNAVAILABLE) when the stream has already ended."""
        ...

    def results(self) -> AsyncIterator[pb.BatchResult]:
        """The results as they come; ends when the stage ended the stream cleanly, raises
        PipelineError with the stage's status when it ended it with one."""
        ...

    async def finish(self) -> None:
        """No more batches: the stage answers those it has, then ends the stream."""
        ...

    def cancel(self) -> None:
        """Drop the stream now (the stage frees the sessions it opened)."""
        ...


class GrpcBatchStream:
    """A BatchStream over a gRPC call: stub.Pipeline() of a stage at `peer`."""

    def __init__(self, call: grpc.aio.StreamStreamCall, peer: str) -> None:
        self.call = call
        self.peer = peer

    async def send(self, batch: pb.Batch) -> None:
        try:
            await self.call.write(batch)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            # the stream already ended: its reader reports the stage's own status
            raise PipelineError(grpc.StatusCode.UNAVAILABLE, f"stage {self.peer} unreachable: {err}") from err

    async def results(self) -> AsyncIterator[pb.BatchResult]:
        try:
            async for result in self.call:
                yield result
        except grpc.aio.AioRpcError as err:
            raise PipelineError(err.code(), err.details() or str(err.code())) from err

    async def finish(self) -> None:
        try:
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # already ended: nothing left to finish

    def cancel(self) -> None:
        self.call.cancel()


class RemoteStage:
    """A stage process at `address`. Its channel belongs to the event loop that makes it, so it is
    made on first use (connect), and made again after close."""

    def __init__(self, address: str, tls: TlsMaterial | None = None, max_message_bytes: int | None = None) -> None:
        self.address = address
        self.tls = tls
        self.max_message_bytes = max_message_bytes  # the plan's (transport.message_limit); None: the fallback
        self._channel: grpc.aio.Channel | None = None

    @property
    def peer(self) -> str:
        return self.address

    def connect(self) -> None:
        if self._channel is None:
            self._channel = aio_channel(self.address, self.tls, channel_options(self.max_message_bytes))
            self._stage = pb_grpc.StageStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)

    def open_stream(self) -> GrpcBatchStream:
        self.connect()
        return GrpcBatchStream(self._stage.Pipeline(), self.address)

    async def serving(self, timeout: float) -> bool:
        """Whether its grpc.health.v1 says SERVING (asked as protocol.health asks it)."""
        self.connect()
        try:
            reply = await self._health.Check(health.REQUEST, timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return health.is_serving(reply)

    async def info(self, timeout: float) -> pb.StageInfo:
        self.connect()
        try:
            return await self._stage.Info(pb.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise PipelineError(err.code(), f"stage {self.address}: {err.details()}") from err

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
