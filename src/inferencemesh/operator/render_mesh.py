"""The mesh-wide objects: the plan's ConfigMap, the router (its Deployment, the least privilege
it needs and its disruption budget), the endpoint Service, the headless Service over every
pipeline's frontend, the pipelines' disruption budget, and the Secrets of the certificates the
operator issues. Pure: no API calls.

Disruption budgets bound voluntary evictions (a node drain, the cluster autoscaler), which no
rollout logic sees coming: the operator never takes the last serving pipeline down, and neither
may an eviction. The mesh's pipeline pods (every frontend and stage, all pipelines) share one
budget: a pipeline is down when any one of its pods is, and two budgets (frontends, stages) would
let an eviction each take two pipelines down at once. With N pods unavailable at most N pipelines
are down, so the budget allows max(1, spec.rollout.maxUnavailable) evictions, never more than
spec.replicas - 1: with one pipeline, none (scale to two to drain its node). A pod counts only
while it is Ready, so after an eviction the next waits until the evicted pod's pipeline serves
again; a pod that is not Ready serves nothing and may always be evicted (unhealthyPodEvictionPolicy,
Kubernetes 1.26+; older servers drop the field and count it against the budget). The router keeps
one replica available the same way.
"""

from __future__ import annotations

import base64
import copy
import json

from inferencemesh.config import FRONTEND_PORT, RouterConfig
from inferencemesh.flags import to_argv
from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import (
    LABEL_COMPONENT,
    LABEL_MESH,
    base_name,
    ca_secret_name,
    endpoint_service_name,
    frontends_selector,
    mesh_labels,
    pipelines_service_name,
    plan_name,
    router_name,
    router_selector,
    tls_secret_name,
)
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.render_frontend import api_key_env
from inferencemesh.operator.render_pod import (
    CONTAINER_SECURITY,
    RenderOptions,
    metrics_annotations,
    object_meta,
    pod_spec,
)
from inferencemesh.operator.spec import MeshSpec
from inferencemesh.planner import render_plan

# The router's preStop wait: endpoints and kube-proxy forget a leaving router pod before it stops.
ROUTER_PRE_STOP_SECONDS = 5


def render_endpoint_service(base: str, namespace: str, spec: MeshSpec) -> dict:
    """The mesh's OpenAI endpoint: the router's pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(endpoint_service_name(base), namespace, {**mesh_labels(base), **router_selector(base)}),
        "spec": {
            "type": spec.frontend.service_type,
            "selector": router_selector(base),
            "ports": [{"name": "http", "port": spec.frontend.service_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pipelines_service(base: str, namespace: str) -> dict:
    """Headless, over every pipeline's frontend: its EndpointSlices list the ready frontends, which
    the router watches (a draining or failed pipeline's frontend is not ready, so not listed)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pipelines_service_name(base), namespace,
                          {**mesh_labels(base), LABEL_COMPONENT: "pipelines"}),
        "spec": {
            "clusterIP": "None",
            "selector": frontends_selector(base),
            "ports": [{"name": "http", "port": FRONTEND_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_router(base: str, namespace: str, spec: MeshSpec, opts: RenderOptions) -> list[dict]:
    """The router's Deployment, the least privilege it needs (its own ServiceAccount, allowed to
    read and watch EndpointSlices in the mesh's namespace, nothing else) and its disruption budget
    (one router pod stays up through evictions)."""
    name = router_name(base)
    labels = {**mesh_labels(base), **router_selector(base)}
    config = RouterConfig(frontends_service=pipelines_service_name(base), namespace=namespace,
                          port=FRONTEND_PORT, frontend_port=FRONTEND_PORT).check()
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container = {
        "name": "router",
        "image": spec.images.frontend or opts.frontend_image,
        "imagePullPolicy": spec.images.pull_policy,
        "args": ["router", *to_argv(config)],
        # the frontends' API key, which the router presents on its own requests to them
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"}, *api_key_env(spec)],
        "ports": [{"name": "http", "containerPort": FRONTEND_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "resources": copy.deepcopy(spec.router.resources),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        # A loaded node starts Python slowly, and a probe's default 1 s is short there (the cluster
        # tests saw the kubelet kill a router mid-rollout on liveness timeouts).
        "startupProbe": {**health, "periodSeconds": 2, "failureThreshold": 90, "timeoutSeconds": 3},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
        # Ready once a pipeline is: before that the endpoint has nothing to serve with.
        # Its answer is in-process and cheap, but a 2-core node loading new pods starves it for
        # seconds: 3 misses of 5 s before a router leaves the Service.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 3,
                           "timeoutSeconds": 5},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ROUTER_PRE_STOP_SECONDS)]}}},
    }
    pod = pod_spec(spec, container, [{"name": "tmp", "emptyDir": {}}], node_selector=spec.router.node_selector,
                    tolerations=spec.router.tolerations, affinity=None)
    pod["serviceAccountName"] = name
    pod["automountServiceAccountToken"] = True  # it watches the pipelines' endpoints
    meta = object_meta(name, namespace, labels)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": copy.deepcopy(meta),
         "automountServiceAccountToken": False},  # only the router's pods mount it
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": copy.deepcopy(meta),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": copy.deepcopy(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": copy.deepcopy(meta),
            "spec": {
                "replicas": spec.router.replicas,
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "selector": {"matchLabels": router_selector(base)},
                "template": {"metadata": {"labels": labels, "annotations": metrics_annotations(spec, FRONTEND_PORT)},
                             "spec": pod},
            },
        },
        _disruption_budget(copy.deepcopy(meta), {"matchLabels": router_selector(base)}, min_available=1),
    ]


def _disruption_budget(meta: dict, selector: dict, *, min_available: int | None = None,
                       max_unavailable: int | None = None) -> dict:
    limit = {"minAvailable": min_available} if min_available is not None else {"maxUnavailable": max_unavailable}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
            "spec": {**limit, "selector": selector, "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def render_pipelines_budget(base: str, namespace: str, spec: MeshSpec) -> dict:
    """One disruption budget over every pipeline's pods, frontends and stages (see the module's doc)."""
    allowed = max(0, min(max(1, spec.rollout.max_unavailable), spec.replicas - 1))
    selector = {"matchLabels": {LABEL_MESH: base},
                "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": ["frontend", "stage"]}]}
    meta = object_meta(pipelines_service_name(base), namespace, {**mesh_labels(base), LABEL_COMPONENT: "pipelines"})
    return _disruption_budget(meta, selector, max_unavailable=allowed)


def render_plan_configmap(mesh: dict, spec: MeshSpec, plan: Plan) -> dict:
    base, ns = base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"]
    doc = {"model": spec.model.name, "planHash": plan.hash, **plan.to_dict()}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(plan_name(base), ns, {**mesh_labels(base), LABEL_COMPONENT: "plan"}),
        "data": {
            "plan.json": json.dumps(doc, indent=2, sort_keys=True) + "\n",
            "plan.txt": render_plan(list(plan.stages)) + "\n",
        },
    }


def _secret(mesh: dict, name: str, secret_type: str, data: dict[str, bytes], component: str) -> dict:
    base, ns = base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(name, ns, {**mesh_labels(base), LABEL_COMPONENT: component}),
        "type": secret_type,
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())},
    }


def render_certificate_secrets(mesh: dict, certificates: MeshCertificates) -> list[dict]:
    """The CA Secret (its keys stay there: no pod mounts it) and one kubernetes.io/tls Secret per
    component: tls.crt, tls.key and ca.crt (the trust bundle), the layout tls.load() reads."""
    base = base_name(mesh["metadata"]["name"])
    secrets = [_secret(mesh, ca_secret_name(base), "Opaque", certificates.ca.to_data(), "certificate-authority")]
    for component, leaf in sorted(certificates.leaves.items()):
        secrets.append(_secret(mesh, tls_secret_name(component), "kubernetes.io/tls",
                               {"tls.crt": leaf.cert, "tls.key": leaf.key, "ca.crt": leaf.ca}, "certificate"))
    return secrets
