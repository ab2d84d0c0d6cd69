"""The chart's autoscaler for an InferenceMesh (templates/autoscaling.yaml), rendered offline with the
Helm Go SDK (helm-python-sdk, as tests/operator/test_monitoring.py renders the chart): an HPA on the
mesh's /scale subresource (autoscaling/v2 where the cluster serves it, else v2beta2) or a KEDA
ScaledObject, which fails the render where KEDA's API is absent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from helm_python import _native
from helm_python.errors import HelmError

from inferencemesh.operator.names import base_name, frontend_name, pipeline_prefix

CHART = Path(__file__).resolve().parents[1] / "charts" / "inferencemesh"
HPA_V2 = "autoscaling/v2/HorizontalPodAutoscaler"
KEDA = "keda.sh/v1alpha1/ScaledObject"
TARGET = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "name": "code"}


def render(values: dict | None = None, api_versions: tuple[str, ...] = (), kube_version: str | None = None
           ) -> dict[str, str]:
    """`helm template --namespace imesh-system [--api-versions ...] [--kube-version ...]`. helm-python's
    Chart.render takes neither option; the native call it wraps does."""
    opts: dict = {"name": "imesh", "namespace": "imesh-system", "is_install": True, "api_versions": list(api_versions)}
    if kube_version is not None:
        opts["kube_version"] = kube_version
    chart = helm.Chart.load(str(CHART))
    return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)))


def autoscalers(out: dict[str, str]) -> list[dict]:
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
            if d and d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]


def scaling(kind: str, **extra: object) -> dict:
    return {"autoscaling": {"enabled": True, "kind": kind, "mesh": {"name": "code", "namespace": "ml"}, **extra}}


KEDA_VALUES = scaling("keda", prometheus={"serverAddress": "http://prometheus-operated.monitoring.svc:9090"})


def test_disabled_by_default_renders_no_autoscaler() -> None:
    out = render(api_versions=(HPA_V2, KEDA))
    assert not autoscalers(out)
    assert not out.get("inferencemesh/templates/autoscaling.yaml", "").strip()


def _check_hpa(hpa: dict, waiting: str = "4") -> None:
    assert hpa["metadata"]["name"] == "code" and hpa["metadata"]["namespace"] == "ml"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == TARGET
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    assert spec["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "inferencemesh_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": waiting}}}]
    # Pipelines are slow to start and drain on the way out: one at a time, scale-down stabilized.
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert spec["behavior"]["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]


def test_hpa_on_a_server_with_autoscaling_v2() -> None:
    (hpa,) = autoscalers(render(scaling("hpa"), api_versions=(HPA_V2,), kube_version="v1.22.0"))
    assert hpa["apiVersion"] == "autoscaling/v2"
    _check_hpa(hpa)
    # Offline without --api-versions, Helm's default Kubernetes version (newer than 1.23) has v2 too.
    (offline,) = autoscalers(render(scaling("hpa")))
    assert offline["apiVersion"] == "autoscaling/v2"


def test_hpa_without_autoscaling_v2_is_v2beta2() -> None:
    (hpa,) = autoscalers(render(scaling("hpa", waitingRequestsPerPipeline=2.5, behavior=None), kube_version="v1.22.0"))
    assert hpa["apiVersion"] == "autoscaling/v2beta2" and hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["scaleTargetRef"] == TARGET
    assert hpa["spec"]["metrics"][0]["pods"]["target"] == {"type": "AverageValue", "averageValue": "2.5"}
    assert "behavior" not in hpa["spec"]  # null keeps the HPA's own defaults


def test_hpa_namespace_defaults_to_the_release() -> None:
    (hpa,) = autoscalers(render({"autoscaling": {"enabled": True, "mesh": {"name": "code"}}}))
    assert hpa["metadata"]["namespace"] == "imesh-system" and hpa["kind"] == "HorizontalPodAutoscaler"


def test_keda_with_the_api() -> None:
    (so,) = autoscalers(render(KEDA_VALUES, api_versions=(KEDA,)))
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    assert so["metadata"]["namespace"] == "ml"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == TARGET
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert meta["threshold"] == "4"
    assert meta["query"] == ('sum(inferencemesh_num_requests_waiting{namespace="ml", '
                             'pod=~"code-p[0-9]+-frontend-.*"})')
    # The pod pattern matches the frontend pods of every pipeline the operator names (a Deployment's
    # pods: NAME-<template hash>-<suffix>), and no stage or router pod.
    pattern = re.compile(r"code-p[0-9]+-frontend-.*")
    for k in (0, 1, 12):
        assert pattern.fullmatch(frontend_name(pipeline_prefix(base_name("code"), k)) + "-7d9f8b6c4-x2k9z")
    for other in ("code-p0-stage-1-7d9f8b6c4-x2k9z", "code-router-7d9f8b6c4-x2k9z", "code-frontend-7d9f8b6c4-x2k9z"):
        assert not pattern.fullmatch(other)


@pytest.mark.parametrize("mesh", ["code", "a" * 41, "9lives", "my.mesh.v2", "x" * 200])
def test_keda_query_uses_the_operators_name_prefix(mesh: str) -> None:
    """A mesh name that is no short DNS-1035 label is folded and hashed (names.base_name): the query's
    pod pattern uses the same prefix as the pods."""
    values = {"autoscaling": {**KEDA_VALUES["autoscaling"], "mesh": {"name": mesh, "namespace": "ml"}}}
    (so,) = autoscalers(render(values, api_versions=(KEDA,)))
    assert so["spec"]["scaleTargetRef"]["name"] == mesh
    assert f'pod=~"{base_name(mesh)}-p[0-9]+-frontend-.*"' in so["spec"]["triggers"][0]["metadata"]["query"]


def test_keda_query_override_and_threshold() -> None:
    values = {"autoscaling": {**KEDA_VALUES["autoscaling"], "waitingRequestsPerPipeline": 8,
                              "prometheus": {"serverAddress": "http://prom:9090", "query": "sum(up)"}}}
    (so,) = autoscalers(render(values, api_versions=(KEDA,)))
    assert so["spec"]["triggers"][0]["metadata"] == {"serverAddress": "http://prom:9090", "query": "sum(up)",
                                                     "threshold": "8"}


def test_keda_without_the_api_fails_naming_it() -> None:
    with pytest.raises(HelmError, match=r"keda\.sh/v1alpha1 ScaledObject API"):
        render(KEDA_VALUES)


@pytest.mark.parametrize(("values", "message"), [
    ({"autoscaling": {"enabled": True}}, "autoscaling.mesh.name"),
    (scaling("keda"), "autoscaling.prometheus.serverAddress"),
    (scaling("hpa", minReplicas=5, maxReplicas=2), "minReplicas"),
])
def test_incomplete_values_fail_with_a_message(values: dict, message: str) -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render(values, api_versions=(KEDA,))


@pytest.mark.parametrize("values", [
    {"autoscaling": {"kind": "vpa"}},
    {"autoscaling": {"minReplicas": 0}},
    {"autoscaling": {"waitingRequestsPerPipeline": 0}},
    {"autoscaling": {"mesh": {"name": "Bad_Name"}}},
    {"autoscaling": {"maxReplica": 3}},
])
def test_the_schema_refuses_bad_values(values: dict) -> None:
    with pytest.raises(HelmError):
        render(values)


def test_the_schema_accepts_the_defaults() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert defaults["autoscaling"]["enabled"] is False
    assert not autoscalers(render(defaults))


def test_the_readme_examples_are_what_the_chart_renders() -> None:
    """The chart README's HPA and ScaledObject examples (mesh `code` in `default`) match the rendered ones."""
    readme = (CHART / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    shown = {b["kind"]: b for b in blocks if isinstance(b, dict) and b.get("kind") in ("HorizontalPodAutoscaler",
                                                                                        "ScaledObject")}
    mesh = {"name": "code", "namespace": "default"}
    server = shown["ScaledObject"]["spec"]["triggers"][0]["metadata"]["serverAddress"]
    (hpa,) = autoscalers(render({"autoscaling": {"enabled": True, "mesh": mesh}}))
    (so,) = autoscalers(render({"autoscaling": {"enabled": True, "kind": "keda", "mesh": mesh,
                                                "prometheus": {"serverAddress": server}}}, api_versions=(KEDA,)))
    for rendered in (hpa, so):
        example = shown[rendered["kind"]]
        assert example["apiVersion"] == rendered["apiVersion"]
        assert {k: rendered["metadata"][k] for k in ("name", "namespace")} == example["metadata"]
        for key, value in example["spec"].items():
            assert rendered["spec"][key] == value, key
