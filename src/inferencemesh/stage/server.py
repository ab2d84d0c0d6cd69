"""The stage behind gRPC: the Stage service (Pipeline, Info) and grpc.health.v1 over one
StageService, and its link to the next stage process.

Each Pipeline call is one upstream stream (stream.py): its batches are pumped into a
StageStream, and the stream ends with the status of the Fault that ended it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferencemesh import tls
from inferencemesh.config import StageConfig
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.streams import RemoteStage
from inferencemesh.protocol.transport import SERVICE_NAME, server_options
from inferencemesh.stage.service import StageService
from inferencemesh.stage.stream import StageStream

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import StageRuntime


async def _pump(batches: AsyncIterator[pb.Batch], stream: StageStream) -> None:
    """Move inbound batches into the stream's inbox, where downstream faults also land."""
    try:
        async for batch in batches:
            stream.put(batch)
    except asyncio.CancelledError:
        raise
    except Exception:  # the sender went away: same as a closed stream
        pass
    stream.end()


class StageGrpcEndpoint(pb_grpc.StageServicer):
    """The gRPC face of a StageService, with its health service and the next stage's address."""

    def __init__(self, service: StageService) -> None:
        self.service = service
        self.health = health.aio.HealthServicer()
        self.serving = False  # what grpc.health.v1 says now (set_serving)
        options = service.options
        self.next_stage = RemoteStage(options.downstream, tls.load(options.tls_dir), options.max_message_bytes) \
            if options.downstream else None
        service.on_serving.append(self.set_serving)
        if self.next_stage is not None:
            service.on_close.append(self.next_stage.close)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def not_serving_reason(self) -> str:
        """Why grpc.health.v1 does not say SERVING, "" while it does: what the stage's /ready answers
        (the kubelet's readiness probe, in-process: stage/metrics_http.py)."""
        if self.serving:
            return ""
        service = self.service
        if service.state == "failed":
            return f"failed: {service.reason}"
        if service.ready:
            return "draining: the stage is stopping"
        return f"{service.state} ({100 * service.progress:.0f}%)"

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """Only the peers this stage serves may call it: with --peers, the caller's certificate
        (mutual TLS has verified it against the mesh's CA) must carry one of those names: the
        mesh's frontend or the stage before this one, not any other pod the CA signed."""
        allowed = self.service.options.peers
        if not allowed:
            return
        names = [n.decode("utf-8", "replace") for n in context.auth_context().get("x509_common_name", [])]
        if not any(name in allowed for name in names):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"stage {self.service.index}: certificate {', '.join(names) or '(none)'} may not "
                                f"call this stage; it serves {', '.join(allowed)}")

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.StageInfo:  # noqa: N802
        await self._admit(context)
        return self.service.info()

    async def Pipeline(self, request_iterator: AsyncIterator[pb.Batch], context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        """One upstream connection: its batches in order, each computed in one pass and sent on
        (or, on the last stage, answered); the sessions it opened are freed when it ends."""
        await self._admit(context)
        stream = StageStream(self.service, context.write, self.next_stage)
        pump = asyncio.create_task(_pump(request_iterator, stream))
        try:
            await stream.run()
        except Fault as fault:
            await context.abort(fault.code, f"stage {self.service.index}: {fault.message}")
        finally:
            pump.cancel()


async def start_stage_server(options: StageConfig, *, runtime: StageRuntime | None = None,
                             compute: Executor | None = None, on_failed: Callable[[str], None] | None = None,
                             ) -> tuple[grpc.aio.Server, StageService, int]:
    """Start the gRPC server (stage service + health) and begin loading; returns the bound port.
    on_failed: called on the event loop with the reason if the layers cannot be loaded."""
    service = StageService(options, runtime=runtime, compute=compute)
    if on_failed is not None:
        service.on_failed.append(on_failed)
    endpoint = StageGrpcEndpoint(service)
    service.metrics.readiness = endpoint.not_serving_reason  # /ready says what grpc.health.v1 says
    server = grpc.aio.server(options=server_options(options.max_message_bytes))
    pb_grpc.add_StageServicer_to_server(endpoint, server)
    health_pb2_grpc.add_HealthServicer_to_server(endpoint.health, server)
    address = f"{options.host}:{options.port}"
    credentials = tls.load(options.tls_dir)
    port = server.add_secure_port(address, credentials.server_credentials()) if credentials else \
        server.add_insecure_port(address)
    await server.start()
    await endpoint.set_serving(service.ready)
    if not service.ready:
        threading.Thread(target=service.load, args=(asyncio.get_running_loop(),), name="stage-load",
                         daemon=True).start()
    service.start_sweeping()
    return server, service, port
