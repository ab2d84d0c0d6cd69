"""Disruption budgets and the router's stop: what an eviction (a node drain, the cluster autoscaler)
may take from a mesh. The router keeps one pod; the pipelines' pods share one budget that never lets
an eviction take the last serving pipeline (render_mesh.py's doc says why one budget, and why that
many evictions)."""

from __future__ import annotations

import pytest
from imesh_k8s import ControlPlane, OperatorProcess, wait_for
from render_fixtures import children, container

from inferencemesh.operator import render_mesh as M
from inferencemesh.operator.spec import parse_spec


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector's meaning (matchLabels and the In operator, all the budgets use)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    assert all(e["operator"] == "In" for e in selector.get("matchExpressions", []))
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def pods_and_budgets(spec: dict) -> tuple[dict[str, dict[str, str]], dict[str, dict]]:
    """Each Deployment's pod labels, and every budget of the mesh."""
    objs = children(spec)
    pods = {name: d["spec"]["template"]["metadata"]["labels"]
            for (kind, name), d in objs.items() if kind == "Deployment"}
    return pods, {name: b for (kind, name), b in objs.items() if kind == "PodDisruptionBudget"}


def test_every_pod_has_exactly_one_budget_the_router_keeps_one_and_a_pipeline_never_goes_alone() -> None:
    spec = {"model": {"name": "bundled://imesh-code-target"}, "replicas": 2}
    pods, budgets = pods_and_budgets(spec)
    for name, labels in pods.items():
        # The eviction API refuses a pod that two budgets select: exactly one each.
        assert [b for b, doc in budgets.items() if selects(doc["spec"]["selector"], labels)] == \
               ["code-router" if name == "code-router" else "code-pipelines"], name
    router = budgets["code-router"]
    assert router["apiVersion"] == "policy/v1" and router["metadata"]["namespace"] == "ml"
    assert router["spec"]["minAvailable"] == 1 and "maxUnavailable" not in router["spec"]
    pipelines = budgets["code-pipelines"]["spec"]
    assert pipelines["maxUnavailable"] == 1 and "minAvailable" not in pipelines
    # A pod that is not Ready serves nothing: a drain may take it whatever the budget says.
    assert router["spec"]["unhealthyPodEvictionPolicy"] == pipelines["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize(("replicas", "max_unavailable", "allowed"), [
    (1, 0, 0),   # the only pipeline is the last serving one: no eviction (scale to two to drain its node)
    (1, 3, 0),
    (2, 0, 1),   # one pipeline may go while the other serves, even where a rollout keeps them all
    (3, 2, 2),   # what the user lets a rollout take, an eviction may take
    (3, 5, 2),   # never the last one
    (0, 0, 0),
])
def test_the_pipelines_budget_never_takes_the_last_serving_pipeline(replicas: int, max_unavailable: int,
                                                                    allowed: int) -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "replicas": replicas,
                       "rollout": {"maxSurge": 1, "maxUnavailable": max_unavailable}})
    assert M.render_pipelines_budget("code", "ml", spec)["spec"]["maxUnavailable"] == allowed


def test_a_leaving_router_waits_for_the_endpoints_to_forget_it() -> None:
    router = children()[("Deployment", "code-router")]
    c, pod = container(router), router["spec"]["template"]["spec"]
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(M.ROUTER_PRE_STOP_SECONDS)]}}}
    assert 0 < M.ROUTER_PRE_STOP_SECONDS < pod["terminationGracePeriodSeconds"] - 10  # streams get the rest
    strategy = router["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxUnavailable": 0, "maxSurge": 1}  # a rollout never has fewer routers either


@pytest.mark.k8s
@pytest.mark.slow
def test_the_operator_writes_the_routers_budget_in_the_version_the_server_serves(
        cluster: ControlPlane, operator: OperatorProcess) -> None:
    """Through the chart's RBAC, on the test control plane (1.20: policy/v1beta1, where policy/v1
    does not exist yet); the operator's Kube reads it back by the kind alone."""
    from kubernetes import config

    from inferencemesh.operator.kube import Kube

    ns = "disruption-tests"
    cluster.kubectl("create", "namespace", ns)
    try:
        cluster.apply({"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
                       "metadata": {"name": "budget"},
                       "spec": {"model": {"name": "bundled://imesh-code-target", "dtype": "float32"},
                                "stages": {"count": 2, "gpus": 0, "device": "cpu"}}}, ns)
        found = wait_for(lambda: len(items := cluster.get_json("poddisruptionbudgets", "-n", ns)["items"]) == 2
                         and items, 60, "the router's and the pipelines' disruption budgets")
        budget = next(b for b in found if b["metadata"]["name"] == "budget-router")  # type: ignore[attr-defined]
        pipelines = next(b for b in found if b["metadata"]["name"] == "budget-pipelines")  # type: ignore[attr-defined]
        assert pipelines["spec"]["maxUnavailable"] == 0  # one pipeline: the last serving one
        assert budget["spec"]["minAvailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
        kube = Kube(config.new_client_from_config(config_file=str(operator.kubeconfig)))
        minor = kube.server_minor_version()
        read = kube.get("PodDisruptionBudget", ns, "budget-router")
        assert read is not None and read["apiVersion"] == ("policy/v1" if minor >= 21 else "policy/v1beta1")
        assert read["metadata"]["ownerReferences"][0]["kind"] == "InferenceMesh"
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
