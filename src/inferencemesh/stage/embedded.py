"""The first stage inside the frontend process (the seeds' "stage 0 + OpenAI frontend").

The frontend's pipeline reaches an embedded stage through LocalStageStub, which has the shape of
the generated gRPC stub (Pipeline, Info, and the health service's Check) but hands each message
to the StageService object in this process. So an embedded stage runs exactly the handlers a
stage process runs (sessions, batches, FORK and RELEASE, the stream to the next stage), without
a socket, serialisation or a process between the frontend and stage 0: one hop and one process
fewer per token.

Its compute runs inline, on the event loop's thread, which is the one thread that computes in
the frontend (the draft model's proposals run there too): a second computing thread would bring
a second OpenMP team whose idle workers spin against the first (see programs.stage.MainThreadExecutor).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from inferencemesh.config import StageConfig
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.stage.server import StageService

log = logging.getLogger("inferencemesh.stage.embedded")

_DONE = object()  # the caller finished writing / the handler returned


class InlineExecutor(Executor):
    """Runs submitted work at once, on the submitting thread (here: the event loop's)."""

    inline = True  # StageService calls such work directly instead of awaiting a future

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # delivered to the awaiting coroutine
            future.set_exception(err)
        return future


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a caller of a real stub sees when the handler ends with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Context:
    """The part of grpc.aio.ServicerContext that the stage's handlers use."""

    def __init__(self, replies: asyncio.Queue | None = None) -> None:
        self._replies = replies

    async def write(self, message: Any) -> None:
        self._replies.put_nowait(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class _StreamCall:
    """stub.Pipeline() into a local handler, run as a task: batches in (each copied, as a real
    write serialises it, so the caller may reuse its message), results out, and the way the
    handler ends (return, abort, crash) reaches the caller as grpc.aio reports it."""

    def __init__(self, handler: Callable[[AsyncIterator, _Context], Any]) -> None:
        self._requests: asyncio.Queue = asyncio.Queue()
        self._replies: asyncio.Queue = asyncio.Queue()
        self._writing = True
        self._task = asyncio.create_task(self._run(handler))

    async def _run(self, handler: Callable[[AsyncIterator, _Context], Any]) -> None:
        try:
            await handler(self._inbound(), _Context(self._replies))
            self._replies.put_nowait(_DONE)
        except _Aborted as err:
            self._replies.put_nowait(_rpc_error(err.code, err.details))
        except asyncio.CancelledError:
            self._replies.put_nowait(_rpc_error(grpc.StatusCode.CANCELLED, "cancelled"))
            raise
        except Exception as err:  # a handler bug: an UNKNOWN status, as grpc gives the remote caller
            log.exception("embedded stage handler failed")
            self._replies.put_nowait(_rpc_error(grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}"))

    async def _inbound(self) -> AsyncIterator:
        while True:
            message = await self._requests.get()
            if message is _DONE:
                return
            yield message

    async def write(self, message: Any) -> None:
        if not self._writing or self._task.done():
            raise grpc.aio.UsageError("the embedded stage's stream has ended")
        copy = type(message)()
        copy.CopyFrom(message)
        self._requests.put_nowait(copy)

    async def done_writing(self) -> None:
        if self._writing:
            self._writing = False
            self._requests.put_nowait(_DONE)

    def __aiter__(self) -> AsyncIterator:
        return self._read()

    async def _read(self) -> AsyncIterator:
        while True:
            item = await self._replies.get()
            if item is _DONE:
                return
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            yield item

    def cancel(self) -> bool:
        return self._task.cancel()


class LocalStageStub:
    """pb_grpc.StageStub's interface, answered by a StageService in this process."""

    def __init__(self, service: StageService) -> None:
        self.service = service

    def Pipeline(self) -> _StreamCall:  # noqa: N802 - the generated stub's method names
        return _StreamCall(self.service.Pipeline)

    async def Info(self, request: pb.InfoRequest, timeout: float | None = None) -> pb.StageInfo:  # noqa: N802
        return await self.service.Info(request, _Context())


class LocalHealthStub:
    """health_pb2_grpc.HealthStub's Check for the embedded stage: SERVING once its layers are
    loaded (the state a stage process's health service follows; it has no shutdown of its own)."""

    def __init__(self, service: StageService) -> None:
        self.service = service

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    timeout: float | None = None) -> health_pb2.HealthCheckResponse:
        ready = self.service.state == "ready" and self.service.runtime is not None
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


class EmbeddedStage:
    """Stage 0 of the pipeline, in this process. start() (on the serving event loop) builds its
    StageService and loads the layers on a background thread, as a stage process does: until
    then the stage reports downloading / loading, and the frontend is not ready."""

    def __init__(self, config: StageConfig, runtime=None) -> None:
        self.config = config
        self._runtime = runtime
        self.service: StageService | None = None

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        return self.service.metrics.registry if self.service is not None else None

    def start(self) -> StageService:
        if self.service is None:
            service = StageService(self.config, runtime=self._runtime, compute=InlineExecutor())
            self.service = service
            if self._runtime is None:
                loop = asyncio.get_running_loop()
                threading.Thread(target=service.load, args=(loop,), name="first-stage-load", daemon=True).start()
            service.sweeper = asyncio.create_task(service.sweep_forever())
        return self.service

    def stubs(self) -> tuple[LocalStageStub, LocalHealthStub]:
        service = self.start()
        return LocalStageStub(service), LocalHealthStub(service)

    async def close(self) -> None:
        if self.service is not None:
            self.service.sweeper.cancel()
            await self.service.close()
            self.service = None
