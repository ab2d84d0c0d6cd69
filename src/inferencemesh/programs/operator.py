"""`inferencemesh operator`: the kopf operator with a liveness endpoint and a Prometheus endpoint."""

from __future__ import annotations

import logging

import kopf
from prometheus_client import start_http_server

from inferencemesh.config import OperatorConfig


def run_operator(args: OperatorConfig) -> int:
    kopf.configure(verbose=False, log_prefix=True)
    logging.getLogger("inferencemesh").setLevel(logging.INFO)
    # One line per watch event ("Handler ... succeeded") and per probe drowns what matters; errors still show.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("kopf.activities.probe").setLevel(logging.WARNING)
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
