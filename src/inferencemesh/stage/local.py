"""A stage inside another process, called directly: no socket, no serialisation, no process.

LocalStage is the stage's side of the frontend's hop interface (inferencemesh.frontend.engine.hops.Hop:
connect, open_stream, serving, info, close). The frontend embeds the first stage this way (stage
0 runs in the OpenAI frontend's process: one hop and one process fewer per token), and an in-process
pipeline (benchmarks, tests) chains every stage this way. Its batches go through the very
StageStream and StageService a stage process runs (sessions, the KV pool, RELEASE, the stream to
the next stage), so an embedded stage answers as a process does.

Its compute runs inline, on the event loop's thread, which is the one thread that computes in
such a process (the draft model's proposals run there too): a second computing thread would
bring a second OpenMP team whose idle workers spin against the first (see
programs.stage.MainThreadExecutor).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry

from inferencemesh import tls
from inferencemesh.config import StageConfig
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault, PipelineError
from inferencemesh.protocol.streams import RemoteStage
from inferencemesh.stage.compute import InlineExecutor
from inferencemesh.stage.service import StageService
from inferencemesh.stage.stream import NextStage, StageStream

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import StageRuntime

log = logging.getLogger("inferencemesh.stage.local")

_END = object()  # the stage ended the stream cleanly


class LocalBatchStream:
    """A BatchStream (inferencemesh.protocol.streams) into a StageService in this process: each
    batch goes straight into a StageStream, which runs as a task; its results, and the status it
    ends with, come back through a queue."""

    def __init__(self, service: StageService, next_stage: NextStage | None) -> None:
        self._index = service.index
        self._results: asyncio.Queue = asyncio.Queue()
        self._stream = StageStream(service, self._emit, next_stage)
        self._writing = True
        self._task = asyncio.create_task(self._run())

    async def _emit(self, result: pb.BatchResult) -> None:
        self._results.put_nowait(result)

    async def _run(self) -> None:
        try:
            await self._stream.run()
            self._results.put_nowait(_END)
        except Fault as fault:  # the status a stage process would end its gRPC call with
            self._results.put_nowait(PipelineError(fault.code, f"stage {self._index}: {fault.message}"))
        except asyncio.CancelledError:
            self._results.put_nowait(PipelineError(grpc.StatusCode.CANCELLED, "cancelled"))
            raise
        except Exception as err:  # a bug: UNKNOWN, as grpc gives a remote caller; logged here
            log.exception("stage %d's stream failed", self._index)
            self._results.put_nowait(PipelineError(grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}"))

    async def send(self, batch: pb.Batch) -> None:
        if not self._writing or self._task.done():
            raise PipelineError(grpc.StatusCode.UNAVAILABLE, f"stage {self._index}'s stream has ended")
        self._stream.put(batch)

    async def results(self) -> AsyncIterator[pb.BatchResult]:
        while True:
            item = await self._results.get()
            if item is _END:
                return
            if isinstance(item, PipelineError):
                raise item
            yield item

    async def finish(self) -> None:
        if self._writing:
            self._writing = False
            self._stream.end()

    def cancel(self) -> None:
        self._task.cancel()


class LocalStage:
    """One stage in this process. connect() (on the serving event loop) builds its StageService
    and, unless given a loaded runtime, loads the layers on a background thread, as a stage
    process does: until then it reports downloading / loading, and is not serving.

    It sends on to `next_stage` when given (the next LocalStage of an in-process pipeline), else
    to the stage process at config.downstream, if any. `on_failed`: told (on the event loop) the
    one-line reason if the layers cannot be loaded."""

    def __init__(self, config: StageConfig, runtime: StageRuntime | None = None,
                 next_stage: NextStage | None = None, on_failed: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._on_failed = on_failed
        self._runtime = runtime
        self._remote = None if next_stage is not None or not config.downstream else \
            RemoteStage(config.downstream, tls.load(config.tls_dir), config.max_message_bytes)
        self.next_stage: NextStage | None = next_stage or self._remote
        self.service: StageService | None = None

    @property
    def peer(self) -> str:
        return f"{self.config.stage_index} (in this process)"

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        return self.service.metrics.registry if self.service is not None else None

    def connect(self) -> StageService:
        if self.service is None:
            service = StageService(self.config, runtime=self._runtime, compute=InlineExecutor())
            if self._on_failed is not None:
                service.on_failed.append(self._on_failed)
            self.service = service
            if not service.ready:
                threading.Thread(target=service.load, args=(asyncio.get_running_loop(),),
                                 name=f"stage-{self.config.stage_index}-load", daemon=True).start()
            service.start_sweeping()
        return self.service

    def open_stream(self) -> LocalBatchStream:
        return LocalBatchStream(self.connect(), self.next_stage)

    async def serving(self, timeout: float) -> bool:
        return self.connect().ready

    async def info(self, timeout: float) -> pb.StageInfo:
        return self.connect().info()

    async def close(self) -> None:
        if self.service is not None:
            service, self.service = self.service, None
            await service.close()
        if self._remote is not None:
            await self._remote.close()
