"""Prometheus metrics of the operator itself (served by run_operator on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "inferencemesh_operator_reconciles_total", "Reconciles of an InferenceMesh, by outcome", ["result"])
RECONCILE_ERRORS = Counter(
    "inferencemesh_operator_reconcile_errors_total", "Reconciles that raised (retried on the next event)", ["error"])
RECONCILE_SECONDS = Histogram(
    "inferencemesh_operator_reconcile_duration_seconds", "Time spent in one reconcile",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
WRITES = Counter(
    "inferencemesh_operator_writes_total", "API writes the operator made, by verb and kind", ["verb", "kind"])
MESHES = Gauge(
    "inferencemesh_operator_meshes", "InferenceMeshes seen by this operator, by phase", ["phase"])
