"""kopf wiring: which watch events lead to which reconcile. The work itself is in reconcile.py.

Only event handlers are registered (no create/update/resume handlers, no timers, no daemons), so
kopf stores nothing on the objects: no last-handled annotation, no progress status, no finalizer
(a finalizer would block deletion while the operator is down). What kopf would otherwise give us
- retries and a periodic resync - is a small in-process schedule here instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import kopf

from inferencemesh.operator import metrics
from inferencemesh.operator.kube import Kube, load_api_client
from inferencemesh.operator.reconcile import Reconciler
from inferencemesh.operator.render import (
    DEFAULT_FRONTEND_IMAGE,
    DEFAULT_STAGE_IMAGE,
    LABEL_MANAGED_BY,
    LABEL_MESH,
    MANAGED_BY,
    RenderOptions,
    base_name,
)

log = logging.getLogger("inferencemesh.operator")
RESYNC_SECONDS = float(os.environ.get("INFERENCEMESH_RESYNC_SECONDS", "300"))
MAX_BACKOFF_SECONDS = 300.0


class Scheduler:
    """Known meshes, when each is next due for a reconcile, and the failure backoff."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self.due: dict[tuple[str, str], float] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.phases: dict[tuple[str, str], str] = {}
        self.by_base: dict[tuple[str, str], set[str]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def forget(self, namespace: str, name: str) -> None:
        with self.lock:
            key = (namespace, name)
            self.due.pop(key, None)
            self.failures.pop(key, None)
            self.phases.pop(key, None)
            self.by_base.get((namespace, base_name(name)), set()).discard(name)
        self._export_phases()

    def meshes_for(self, namespace: str, base: str) -> list[str]:
        with self.lock:
            return sorted(self.by_base.get((namespace, base), ()))

    def run(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        with self.lock:
            self.by_base.setdefault((namespace, base_name(name)), set()).add(name)
        try:
            result = self.reconciler.reconcile(namespace, name)
        except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff, never raised into kopf
            with self.lock:
                n = self.failures[key] = self.failures.get(key, 0) + 1
                delay = min(MAX_BACKOFF_SECONDS, 2.0 * 2 ** min(n, 8))
                self.due[key] = time.monotonic() + delay
            log.warning("reconcile of %s/%s failed (%s: %s); retrying in %.0fs",
                        namespace, name, type(exc).__name__, exc, delay)
            return
        with self.lock:
            self.failures.pop(key, None)
            self.due[key] = time.monotonic() + (result.retry_after or RESYNC_SECONDS)
            if result.phase:
                self.phases[key] = result.phase
        if result.writes:
            log.info("%s/%s: %s -> %s", namespace, name,
                     ", ".join(f"{w.verb} {w.kind}/{w.name}" for w in result.writes), result.phase)
        self._export_phases()

    def _export_phases(self) -> None:
        with self.lock:
            counts: dict[str, int] = {}
            for phase in self.phases.values():
                counts[phase] = counts.get(phase, 0) + 1
        for phase in ("Pending", "Progressing", "Ready", "Degraded", "Failed"):
            metrics.MESHES.labels(phase).set(counts.get(phase, 0))

    def loop(self) -> None:
        """Retries and periodic resync: reconcile every mesh whose time has come."""
        while not self.stop.wait(2.0):
            now = time.monotonic()
            with self.lock:
                ready = [key for key, when in self.due.items() if when <= now]
            for namespace, name in ready:
                if self.stop.is_set():
                    return
                self.run(namespace, name)


_scheduler: Scheduler | None = None


def _sched() -> Scheduler:
    assert _scheduler is not None, "the startup handler has not run"
    return _scheduler


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: object) -> None:
    global _scheduler
    settings.posting.level = logging.WARNING  # our own Events carry the story; kopf's only errors
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    # Filter pods and deployments at the API server: only the mesh's own, never every pod of the cluster.
    managed = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.watching.label_selectors["v1", "pods"] = managed
    settings.watching.label_selectors["apps", "v1", "deployments"] = managed
    kube = Kube(load_api_client())
    options = RenderOptions(
        stage_image=os.environ.get("INFERENCEMESH_STAGE_IMAGE") or DEFAULT_STAGE_IMAGE,
        frontend_image=os.environ.get("INFERENCEMESH_FRONTEND_IMAGE") or DEFAULT_FRONTEND_IMAGE,
        grpc_probes=kube.server_minor_version() >= 24,
    )
    log.info("render options: %s", options)
    _scheduler = Scheduler(Reconciler(kube, options=options))
    threading.Thread(target=_scheduler.loop, name="resync", daemon=True).start()


@kopf.on.cleanup()
def cleanup(**_: object) -> None:
    if _scheduler is not None:
        _scheduler.stop.set()


@kopf.on.probe(id="meshes")
def probe_meshes(**_: object) -> int:
    return len(_sched().phases)


@kopf.on.event("inferencemesh.io", "v1alpha1", "inferencemeshes")
def mesh_event(type: str | None, name: str, namespace: str, **_: object) -> None:
    if type == "DELETED":
        _sched().forget(namespace, name)
        return
    _sched().run(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY})
@kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: MANAGED_BY})
def child_event(namespace: str, labels: dict, **_: object) -> None:
    """A stage or frontend Deployment/Pod changed: refresh its mesh's status."""
    base = labels.get(LABEL_MESH)
    if not base:
        return
    for name in _sched().meshes_for(namespace, base):
        _sched().run(namespace, name)
