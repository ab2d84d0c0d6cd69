"""`inferencemesh operator`: the kopf operator with a liveness endpoint and a Prometheus endpoint."""

from __future__ import annotations

import kopf
from prometheus_client import start_http_server

from inferencemesh.config import OperatorConfig


def run_operator(args: OperatorConfig) -> int:
    # kopf's own log handler; the levels are set up with every program's (process.set_up_process).
    kopf.configure(verbose=False, log_prefix=True)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    from inferencemesh.operator import handlers  # noqa: F401 - importing registers the kopf handlers

    namespaces = list(args.namespace)
    kopf.run(
        standalone=bool(args.standalone),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0
