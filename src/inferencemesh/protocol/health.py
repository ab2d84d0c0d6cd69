"""A stage's health, asked one way: grpc.health.v1's Check of the whole server ("" service),
SERVING or not. The frontend asks it over its asyncio channel (streams.RemoteStage.serving);
serve's start-up wait and the pods' readiness probe ask it with `check`, a blocking call."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferencemesh.tls import TlsMaterial

REQUEST = health_pb2.HealthCheckRequest(service="")  # the whole server, not one service


def is_serving(reply: health_pb2.HealthCheckResponse) -> bool:
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check(address: str, timeout: float = 3.0, tls: TlsMaterial | None = None, server_name: str | None = None) -> bool:
    """Whether the stage at address says SERVING within timeout (False when it cannot be reached)."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(REQUEST, timeout=timeout)
        except grpc.RpcError:
            return False
    return is_serving(reply)
