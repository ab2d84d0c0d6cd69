"""Tear-down paths, run last (marker e2e_last): deleting a mesh garbage-collects every child;
`helm uninstall` removes the operator and keeps the CRD (and with it every user's meshes)."""

from __future__ import annotations

import pytest
from imesh_e2e import CHILD_KIND_NAMES, CHILD_KINDS, get_json, kubectl, wait_for


@pytest.mark.e2e_last
def test_deleting_the_mesh_collects_every_child(shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    selector = f"inferencemesh.io/mesh={name}"
    children = get_json(CHILD_KINDS, "-n", ns, "-l", selector)["items"]
    kinds = {c["kind"] for c in children}
    assert CHILD_KIND_NAMES <= kinds, kinds
    components = {(c["metadata"].get("labels") or {}).get("app.kubernetes.io/component") for c in children
                  if c["kind"] == "Pod"}
    assert {"stage", "frontend", "router"} <= components, components
    kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=true", "--timeout=120s")
    wait_for(lambda: not get_json(CHILD_KINDS, "-n", ns, "-l", selector)["items"], 240,
             "every child of the mesh to be garbage-collected")


@pytest.mark.e2e_last
def test_helm_uninstall_removes_the_operator_and_keeps_the_crd(settings: dict, release: str) -> None:
    import helm_python as helm

    ns = settings["operator_namespace"]
    with helm.Config(namespace=ns) as cfg:
        cfg.uninstall(release, timeout=300, ignore_not_found=True)
    wait_for(lambda: not get_json("deployments,pods,serviceaccounts", "-n", ns, "-l",
                                  f"app.kubernetes.io/instance={release}")["items"],
             180, "the operator's objects to go")
    assert get_json("crd", "inferencemeshes.inferencemesh.io")["metadata"]["name"]
    assert kubectl("get", "clusterrolebindings", "-o", "name").count(f"{release}-inferencemesh") == 0
