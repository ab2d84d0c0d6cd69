"""The order a mesh's pods go in when the mesh itself is deleted, kept by the garbage collector.

Deleting an InferenceMesh deletes its children through their owner references, all at once: a
frontend would drain its streams (SIGTERM, its preStop wait, then up to drainTimeout) while the
stages and the router those streams pass through were already gone. So each stage Deployment is
also owned by its pipeline's frontend pods, and the router's Deployment by every frontend pod.
The garbage collector deletes an object only once all of its owners are gone: the frontends drain
and exit first, then their stages and the router go. Scale-down and rollouts keep the same order
explicitly (pipelines.decide), and this covers what they cannot: the mesh's own deletion.

The extra references are neither controllers nor blockers. While the mesh exists, its own
reference keeps every child whatever frontend pods come and go, and the reconciler points the
references at the pods that exist now. No finalizer is involved, so a mesh deleted while the
operator is down goes in the same order.
"""

from __future__ import annotations

from inferencemesh.operator.names import LABEL_COMPONENT
from inferencemesh.operator.observe import pipeline_of


def _component(obj: dict) -> str | None:
    return (obj["metadata"].get("labels") or {}).get(LABEL_COMPONENT)


def _pod_reference(pod: dict) -> dict:
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
            "controller": False, "blockOwnerDeletion": False}


def owner_references(deployments: list[dict], pods: list[dict]) -> dict[str, list[dict]]:
    """The owner references each stage and router Deployment should carry (by Deployment name):
    its references to anything but pods (the mesh's), then the frontend pods it waits for, by name.
    Only the Deployments whose references differ from these are in the answer."""
    frontends = sorted((p for p in pods if _component(p) == "frontend"), key=lambda p: p["metadata"]["name"])
    wanted: dict[str, list[dict]] = {}
    for deployment in deployments:
        component = _component(deployment)
        if component == "stage":
            pipeline = pipeline_of(deployment)
            holders = [p for p in frontends if pipeline_of(p) == pipeline]
        elif component == "router":
            holders = frontends
        else:
            continue
        current = deployment["metadata"].get("ownerReferences") or []
        references = [r for r in current if r.get("kind") != "Pod"] + [_pod_reference(p) for p in holders]
        if [(r.get("kind"), r.get("uid")) for r in current] != [(r["kind"], r["uid"]) for r in references]:
            wanted[deployment["metadata"]["name"]] = references
    return wanted
