"""Which frontend pods each stage and router Deployment waits for when the mesh is deleted (pure)."""

from __future__ import annotations

from inferencemesh.operator.teardown import owner_references

MESH_REF = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "name": "m", "uid": "mesh",
            "controller": True, "blockOwnerDeletion": True}


def obj(name: str, component: str, pipeline: int | None, refs: list[dict] | None = None) -> dict:
    labels = {"app.kubernetes.io/component": component}
    if pipeline is not None:
        labels["inferencemesh.io/pipeline"] = str(pipeline)
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": labels,
                         "ownerReferences": refs if refs is not None else [MESH_REF]}}


def pod_ref(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": f"uid-{name}", "controller": False,
            "blockOwnerDeletion": False}


PODS = [obj("m-p1-frontend-b", "frontend", 1), obj("m-p0-frontend-a", "frontend", 0), obj("m-p0-stage-1-x", "stage", 0)]


def test_stages_wait_for_their_own_pipelines_frontend_and_the_router_for_every_frontend() -> None:
    deployments = [obj("m-p0-stage-1", "stage", 0), obj("m-p1-stage-1", "stage", 1), obj("m-router", "router", None),
                   obj("m-p0-frontend", "frontend", 0)]
    wanted = owner_references(deployments, PODS)
    assert wanted == {
        "m-p0-stage-1": [MESH_REF, pod_ref("m-p0-frontend-a")],
        "m-p1-stage-1": [MESH_REF, pod_ref("m-p1-frontend-b")],
        "m-router": [MESH_REF, pod_ref("m-p0-frontend-a"), pod_ref("m-p1-frontend-b")],
    }  # a frontend Deployment waits for nothing


def test_references_already_in_place_need_nothing_and_a_replaced_pod_is_swapped() -> None:
    held = obj("m-p0-stage-1", "stage", 0, [MESH_REF, pod_ref("m-p0-frontend-a")])
    assert owner_references([held], PODS) == {}
    stale = obj("m-p0-stage-1", "stage", 0, [MESH_REF, pod_ref("m-p0-frontend-gone")])
    assert owner_references([stale], PODS) == {"m-p0-stage-1": [MESH_REF, pod_ref("m-p0-frontend-a")]}
    # no frontend pod left (a pipeline drained, a failed one scaled to zero): back to the mesh alone
    assert owner_references([stale], []) == {"m-p0-stage-1": [MESH_REF]}
