"""kopf wiring: which watch events wake which mesh's reconcile loop. The work itself is in reconcile.py.

Each mesh has one worker, an asyncio task kept in the mesh's kopf memo: it reconciles (in a thread,
the API calls block), then sleeps until an event wakes it, its backoff after a failure runs out,
or the periodic resync is due. One worker per mesh means one reconcile of a mesh at a time, with
no locks. The mesh's own events wake it; its Deployments' and Pods' events find it through a kopf
index from (namespace, base name) to the mesh's memo.

Why not @kopf.daemon or @kopf.timer for that loop: kopf puts a finalizer on every object that has
either (both are declared with requires_finalizer=True, and nothing turns that off), and a finalizer
blocks deleting a mesh while the operator is down. With only event and index handlers kopf stores
nothing on the objects (no finalizer, no last-handled annotation, no progress status) and the
children go away through their owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import kopf

from inferencemesh.kube_config import load_api_client
from inferencemesh.operator import metrics
from inferencemesh.operator.kube import Kube
from inferencemesh.operator.names import LABEL_MANAGED_BY, LABEL_MESH, MANAGED_BY, base_name
from inferencemesh.operator.reconcile import Reconciler
from inferencemesh.operator.render_pod import DEFAULT_FRONTEND_IMAGE, DEFAULT_STAGE_IMAGE, RenderOptions

log = logging.getLogger("inferencemesh.operator")
MESHES = ("inferencemesh.io", "v1alpha1", "inferencemeshes")
RESYNC_SECONDS = float(os.environ.get("INFERENCEMESH_RESYNC_SECONDS", "300"))
MAX_BACKOFF_SECONDS = 300.0
PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Failed")


def backoff_seconds(failures: int) -> float:
    """The wait after the n-th failure in a row: 4 s, doubling, at most MAX_BACKOFF_SECONDS."""
    return min(MAX_BACKOFF_SECONDS, 2.0 * 2 ** min(failures, 8))


class MeshWorker:
    """One mesh's reconcile loop (see the module docstring)."""

    def __init__(self, reconciler: Reconciler, namespace: str, name: str) -> None:
        self.wakeup = asyncio.Event()
        self.task = asyncio.create_task(self._loop(reconciler, namespace, name), name=f"mesh {namespace}/{name}")

    def wake(self) -> None:
        self.wakeup.set()

    def stop(self) -> None:
        self.task.cancel()

    async def _loop(self, reconciler: Reconciler, namespace: str, name: str) -> None:
        failures = 0
        while True:
            self.wakeup.clear()  # an event from now on asks for one more pass
            try:
                result = await asyncio.to_thread(reconciler.reconcile, namespace, name)
            except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff, never raised into kopf
                failures += 1
                delay = backoff_seconds(failures)
                log.warning("reconcile of %s/%s failed (%s: %s); retrying in %.0fs",
                            namespace, name, type(exc).__name__, exc, delay)
            else:
                failures = 0
                # sooner when the reconcile asks (the model unreadable yet, a certificate due)
                delay = RESYNC_SECONDS if result.retry_after is None else min(result.retry_after, RESYNC_SECONDS)
                if result.writes:
                    log.info("%s/%s: %s -> %s", namespace, name,
                             ", ".join(f"{w.verb} {w.kind}/{w.name}" for w in result.writes), result.phase)
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: wait_for can lose kopf's cancel (3.11)
                async with asyncio.timeout(delay):
                    await self.wakeup.wait()


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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
    )
    log.info("render options: %s", options)
    memo.reconciler = Reconciler(kube, options=options)  # each mesh's memo starts as a copy of this one


@kopf.index(*MESHES)  # type: ignore[arg-type]  # kopf's protocol names every kwarg; a handler takes what it uses
def mesh_memos(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> dict:
    """(namespace, base name) -> the memo of each mesh whose children carry that name (usually one)."""
    return {(namespace, base_name(name)): memo}


@kopf.index(*MESHES)
def mesh_phases(status: kopf.Status, **_: Any) -> dict:
    """phase -> the meshes whose status is in it."""
    phase = status.get("phase")
    return {phase: None} if phase else {}


@kopf.on.probe(id="meshes")  # type: ignore[arg-type]  # kopf's protocol names every kwarg; a handler takes what it uses
def probe_meshes(mesh_memos: kopf.Index, **_: Any) -> int:
    return sum(len(memos) for memos in mesh_memos.values())


@kopf.on.event(*MESHES)  # type: ignore[arg-type]  # kopf's protocol names every kwarg; a handler takes what it uses
async def mesh_event(type: str | None, namespace: str, name: str, memo: kopf.Memo, mesh_phases: kopf.Index,
                     **_: Any) -> None:
    worker: MeshWorker | None = memo.get("worker")
    if type == "DELETED":
        if worker is not None:
            worker.stop()  # owner references let the garbage collector remove the children
        announcer = getattr(memo.get("reconciler"), "announcer", None)
        if announcer is not None:  # a mesh made again under this name starts unannounced
            announcer.forget(f"{namespace}/{name}")
    elif worker is None or worker.task.done():
        memo.worker = MeshWorker(memo.reconciler, namespace, name)
    else:
        worker.wake()
    for phase in PHASES:
        metrics.MESHES.labels(phase).set(len(mesh_phases.get(phase, ())))


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY})
@kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: MANAGED_BY})  # type: ignore[arg-type]  # kopf's protocol names every kwarg; a handler takes what it uses
async def child_event(namespace: str, labels: dict, mesh_memos: kopf.Index, **_: Any) -> None:
    """A stage or frontend Deployment/Pod changed: its mesh's status may have too."""
    for memo in mesh_memos.get((namespace, labels.get(LABEL_MESH)), ()):
        worker: MeshWorker | None = memo.get("worker")
        if worker is not None:
            worker.wake()
