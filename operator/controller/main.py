"""`inferencemesh operator`: the kopf operator with a liveness endpoint and a Prometheus endpoint."""

from __future__ import annotations

import argparse
import logging

import kopf
from prometheus_client import start_http_server


def run_operator(args: argparse.Namespace) -> int:
    kopf.configure(verbose=False, log_prefix=True)
    logging.getLogger("inferencemesh").setLevel(logging.INFO)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    from . import handlers  # noqa: F401 - importing registers the kopf handlers

    namespaces = args.namespace or []
    kopf.run(
        standalone=bool(args.standalone),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0
