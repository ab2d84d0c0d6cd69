"""`python -m inferencemesh.stage.healthprobe HOST:PORT [--tls-dir DIR --server-name NAME]`.

Exits 0 when grpc.health.v1 says SERVING (protocol.health.check). The stage readiness probe on clusters older than
Kubernetes 1.24 (no native gRPC probes) and on meshes with mutual TLS (the kubelet's gRPC
probe presents no client certificate). Imports only grpcio, never kopf or the operator.
"""

from __future__ import annotations

import argparse
import sys

from inferencemesh.protocol.health import check
from inferencemesh.tls import TlsMaterial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferencemesh.stage.healthprobe")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--tls-dir", default=None, help="tls.crt, tls.key, ca.crt for mutual TLS")
    parser.add_argument("--server-name", default=None, help="the name the server certificate carries")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tls = TlsMaterial.from_dir(args.tls_dir) if args.tls_dir else None
    ok = check(args.address, tls=tls, server_name=args.server_name)
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
