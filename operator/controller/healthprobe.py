"""`python -m inferencemesh.operator.healthprobe HOST:PORT`: exit 0 when grpc.health.v1 says SERVING.

The stage readiness probe on clusters older than Kubernetes 1.24, which lack native gRPC probes.
Imports only grpcio (the stage image has it), never kopf or the operator.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m inferencemesh.operator.healthprobe HOST:PORT", file=sys.stderr)
        return 2
    ok = check(args[0])
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
