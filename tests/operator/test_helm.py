"""A real `helm install` / `helm uninstall` of the chart against the test API server (Helm Go SDK via PyPI)."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
from imesh_k8s import (
    CHART,
    OPERATOR_NAMESPACE,
    RELEASE,
    ControlPlane,
    helm_install,
    start_operator,
    stop_operator,
    wait_for,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def test_the_session_release_is_deployed(cluster: ControlPlane, chart_release: dict) -> None:
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=OPERATOR_NAMESPACE) as cfg:
        status = cfg.status(RELEASE)
    assert status["status"] == "deployed" and status["revision"] == 1
    assert "kubectl get imesh" in status["notes"]
    dep = cluster.get_json("deployment", f"{RELEASE}-inferencemesh-operator", "-n", OPERATOR_NAMESPACE)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["args"][:1] == ["operator"] and "--standalone" in c["args"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    cluster.kubectl("get", "clusterrole", f"{RELEASE}-inferencemesh-operator-cluster")
    cluster.kubectl("get", "crd", "inferencemeshes.inferencemesh.io")


def test_install_and_uninstall_a_namespaced_release(cluster: ControlPlane, chart_release: dict,
                                                    tiny_model: Path) -> None:
    cluster.kubectl("create", "namespace", "team-b")
    values = {"watchNamespaces": ["team-b"], "serviceMonitor": {"enabled": False}}
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace="imesh-b") as cfg:
        release = helm_install(cfg, CHART, "imesh-b", values, "imesh-b", create_namespace=True)
        assert release["status"] == "deployed"
        role = cluster.get_json("role", "imesh-b-inferencemesh-operator", "-n", "team-b")
        assert all("*" not in rule["verbs"] for rule in role["rules"])
        cluster.kubectl("get", "deployment", "imesh-b-inferencemesh-operator", "-n", "imesh-b")
        # the namespaced release's ServiceAccount may manage meshes in team-b only
        sa = "system:serviceaccount:imesh-b:imesh-b-inferencemesh-operator"
        can = lambda *a: cluster.kubectl("auth", "can-i", *a, "--as", sa, check=False).stdout.strip()  # noqa: E731
        assert can("create", "deployments", "-n", "team-b") == "yes"
        assert can("create", "deployments", "-n", "default") == "no"
        # each mesh's router gets its own ServiceAccount, Role and RoleBinding (read EndpointSlices)
        for resource in ("serviceaccounts", "roles", "rolebindings"):
            assert can("create", resource, "-n", "team-b") == "yes", resource
        assert can("watch", "endpointslices.discovery.k8s.io", "-n", "team-b") == "yes"
        assert can("create", "endpointslices.discovery.k8s.io", "-n", "team-b") == "no"
        assert can("create", "roles", "-n", "default") == "no"
        assert can("list", "customresourcedefinitions") == "yes"
        assert [r["name"] for r in cfg.list()] == ["imesh-b"]
        run_namespaced_operator(cluster, tiny_model)
        cfg.uninstall("imesh-b", timeout=120)
    for args in (("deployment", "imesh-b-inferencemesh-operator", "-n", "imesh-b"),
                 ("role", "imesh-b-inferencemesh-operator", "-n", "team-b"),
                 ("clusterrole", "imesh-b-inferencemesh-operator-cluster")):
        wait_for(lambda a=args: cluster.kubectl("get", *a, check=False).returncode != 0, 60, f"{args} to be removed")
    # Helm never deletes CRDs, and the session release is untouched
    cluster.kubectl("get", "crd", "inferencemeshes.inferencemesh.io")
    cluster.kubectl("get", "deployment", f"{RELEASE}-inferencemesh-operator", "-n", OPERATOR_NAMESPACE)


def run_namespaced_operator(cluster: ControlPlane, tiny_model: Path) -> None:
    """The namespaced release's Role is enough for `inferencemesh operator --namespace team-b`."""
    token = cluster.kubectl("create", "token", "imesh-b-inferencemesh-operator", "-n", "imesh-b").stdout.strip()
    kubeconfig = cluster.write_kubeconfig(cluster.workdir / "team-b.kubeconfig", token, "team-b-operator")
    op = start_operator(cluster, kubeconfig, cluster.workdir, {}, namespaces=("team-b",))
    try:
        mesh = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": "nsmesh"},
                "spec": {"model": {"name": str(tiny_model)}}}
        cluster.apply(mesh, "team-b")

        def planned() -> bool:
            status = cluster.get_json("inferencemesh", "nsmesh", "-n", "team-b").get("status") or {}
            return any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions", []))

        wait_for(planned, 60, "the namespaced operator to plan team-b/nsmesh")
        # (the router's Role is granted by the operator: RBAC lets it only grant what it holds itself)
        wait_for(lambda: len(cluster.get_json("deployments", "-n", "team-b", "-l",
                                              "inferencemesh.io/mesh=nsmesh")["items"]) == 4, 30,
                 "nsmesh's Deployments")
        deps = cluster.get_json("deployments", "-n", "team-b", "-l", "inferencemesh.io/mesh=nsmesh")["items"]
        assert sorted(d["metadata"]["name"] for d in deps) == \
            ["nsmesh-p0-frontend", "nsmesh-p0-stage-0", "nsmesh-p0-stage-1", "nsmesh-router"]
        cluster.kubectl("get", "role,rolebinding,serviceaccount", "nsmesh-router", "-n", "team-b")
        assert "Forbidden" not in op.log(200), op.log()
    finally:
        stop_operator(op)
