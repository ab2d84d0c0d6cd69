"""One upstream stream at a stage, whatever carries it, and its link to the next stage.

Per upstream stream (the frontend's, or the previous stage's) a stage keeps one StageStream, and
opens one stream to the next stage for it, whatever the number of sessions: batches go down,
each carried out by the service in order, and the last stage's answers come back up the same
streams. The sessions a stream opened are freed when it ends, and the stage's KV pool, which
serves one stream at a time, is free for the next. The gRPC endpoint (server.py)
feeds a StageStream from a gRPC call; an in-process stage (local.py) from its caller directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault, PipelineError
from inferencemesh.protocol.streams import BatchStream
from inferencemesh.stage.service import StageService
from inferencemesh.stage.sessions import Owner

Emit = Callable[[pb.BatchResult], Awaitable[None]]  # sends a result up the upstream stream

_END = object()  # the upstream finished sending


class NextStage(Protocol):
    """Where a stage sends what it computed: a RemoteStage, or a LocalStage in this process."""

    @property
    def peer(self) -> str: ...

    def open_stream(self) -> BatchStream: ...


class DownstreamLink:
    """One upstream stream's stream to the next stage: batches go down it, and the results that
    come back up are relayed to the upstream as they are. If it breaks, a Fault lands in the
    upstream stream's inbox, which then ends with the same status: the frontend replays."""

    def __init__(self, stream: BatchStream, peer: str, emit: Emit, inbox: asyncio.Queue) -> None:
        self.stream = stream
        self.peer = peer
        self.finishing = False
        self.relay = asyncio.create_task(self._relay(emit, inbox))

    async def _relay(self, emit: Emit, inbox: asyncio.Queue) -> None:
        try:
            async for result in self.stream.results():
                await emit(result)
            if not self.finishing:
                inbox.put_nowait(Fault(grpc.StatusCode.UNAVAILABLE, f"downstream stage {self.peer} ended the stream"))
        except PipelineError as err:
            if err.code != grpc.StatusCode.CANCELLED:
                inbox.put_nowait(Fault(err.code, f"downstream stage {self.peer}: {err}"))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the upstream went away while a result was relayed
            inbox.put_nowait(Fault(grpc.StatusCode.CANCELLED, f"upstream gone: {err}"))

    async def send(self, batch: pb.Batch) -> None:
        try:
            await self.stream.send(batch)
        except PipelineError as err:
            raise Fault(err.code, f"downstream {err}") from err

    async def finish(self) -> None:
        """No more batches: wait until the next stage has answered those it has (it ends its
        stream once it has), so that every result reaches the upstream."""
        self.finishing = True
        await self.stream.finish()
        with contextlib.suppress(Exception):
            await self.relay

    async def close(self) -> None:
        await self.stream.finish()
        self.relay.cancel()
        self.stream.cancel()


class StageStream:
    """One upstream stream: its batches in order, each carried out by the service and sent on
    (or, on the last stage, answered through `emit`). run() returns when the upstream finished
    and every answer went up; it raises the Fault that ends the stream with a status."""

    def __init__(self, service: StageService, emit: Emit, next_stage: NextStage | None) -> None:
        self.service = service
        self.emit = emit
        self.next_stage = next_stage
        self.inbox: asyncio.Queue = asyncio.Queue()  # batches, _END, and a broken link's Fault
        self.owner = Owner()  # the sessions this stream opened are its alone

    def put(self, batch: pb.Batch) -> None:
        self.inbox.put_nowait(batch)

    def end(self) -> None:
        self.inbox.put_nowait(_END)

    async def run(self) -> None:
        service, metrics = self.service, self.service.metrics
        link: DownstreamLink | None = None
        try:
            while True:
                item = await self.inbox.get()
                if item is _END:  # the upstream is done sending: finish what is in flight below
                    if link is not None:
                        await link.finish()
                    return
                if isinstance(item, Fault):
                    raise item
                out = await service.step(item, self.owner)
                if service.is_last:
                    await self.emit(out)
                    continue
                if self.next_stage is None:
                    raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {service.index} is not the last and has no downstream stage")
                if link is None:
                    link = DownstreamLink(self.next_stage.open_stream(), self.next_stage.peer, self.emit, self.inbox)
                sending = time.perf_counter()
                await link.send(out)
                metrics.send.observe(time.perf_counter() - sending)
                metrics.bytes_sent.inc(len(out.activations))
        except Fault as fault:
            metrics.error(fault.code.name)
            raise
        finally:
            # the sender went away: free what it held (before any await: a cancelled stream may
            # not get past one)
            service.release_all(self.owner)
            if link is not None:
                await link.close()
