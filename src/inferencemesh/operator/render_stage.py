"""A pipeline's stage objects: per stage pod a Deployment, a Service and a NetworkPolicy (gRPC
only from its own pipeline's frontend and the stage before it). Pure: no API calls.
"""

from __future__ import annotations

import copy
from functools import partial

from inferencemesh.config import STAGE_GRPC_PORT, STAGE_METRICS_PORT, StageConfig
from inferencemesh.flags import to_argv
from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import (
    frontend_name,
    frontend_selector,
    stage_address,
    stage_name,
    stage_selector,
)
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.render_pod import (
    CONTAINER_SECURITY,
    LAYERS_STARTUP_PROBE,
    POD_ENV,
    PipelineRef,
    RenderOptions,
    metrics_annotations,
    object_meta,
    pod_spec,
    pod_volumes,
    shared_options,
    stage_compute,
    tls_annotation,
)
from inferencemesh.operator.resources import stage_resources
from inferencemesh.operator.spec import MeshSpec
from inferencemesh.tls import stage_peers

# The stage answers its probes in-process on its HTTP (metrics) port, the same with mutual TLS
# (stage/metrics_http.py): no interpreter per probe, no client certificate. Timeouts and thresholds
# hold on a loaded 2-core node, where a Python answer can take a second or two.
READINESS_PROBE = {"httpGet": {"path": "/ready", "port": "metrics"}, "periodSeconds": 5, "timeoutSeconds": 5,
                   "failureThreshold": 3, "successThreshold": 1}
# /live only asks the event loop, which never computes: a stage busy with a long prefill still
# answers. A restart is the last resort: 3 minutes without one answer (6 probes, 10 s each).
LIVENESS_PROBE = {"httpGet": {"path": "/live", "port": "metrics"}, "periodSeconds": 30, "timeoutSeconds": 10,
                  "failureThreshold": 6}


def render_stage_deployment(spec: MeshSpec, plan: Plan, pipe: PipelineRef, index: int, opts: RenderOptions,
                            certificates: MeshCertificates | None = None) -> dict:
    stage = plan.stages[index]
    n = len(plan.stages)
    name = stage_name(pipe.prefix, index)
    config = StageConfig(
        **shared_options(spec, plan), layers=(stage.layer_start, stage.layer_end), stage_index=index, num_stages=n,
        # The metrics port always: it answers the probes too (spec.metrics only advertises /metrics).
        port=STAGE_GRPC_PORT, metrics_port=STAGE_METRICS_PORT,
        downstream=stage_address(pipe.prefix, pipe.namespace, index + 1) if index + 1 < n else None,
        **stage_compute(spec),
        # Certificates the operator issues name their component: only its pipeline's frontend and
        # the stage before may call (a Secret of the user's names nobody we know).
        peers=stage_peers(index, plan.remote_stages[0], frontend_name(pipe.prefix), partial(stage_name, pipe.prefix))
        if spec.issues_certificates else (),
    ).check()
    args = ["stage", *to_argv(config)]
    resources = stage_resources(spec)
    ports = [{"name": "grpc", "containerPort": STAGE_GRPC_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": STAGE_METRICS_PORT, "protocol": "TCP"}]
    volumes, mounts = pod_volumes(spec, name)
    container = {
        "name": "stage",
        "image": spec.images.stage or opts.stage_image,
        "imagePullPolicy": spec.images.pull_policy,
        "args": args,
        "env": copy.deepcopy(POD_ENV),
        "ports": ports,
        "volumeMounts": mounts,
        "resources": resources,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        # Liveness starts once the process answers at all (its loop answers while the layers load).
        "startupProbe": {"httpGet": {"path": "/live", "port": "metrics"}, "timeoutSeconds": 5,
                         **LAYERS_STARTUP_PROBE},
        "livenessProbe": copy.deepcopy(LIVENESS_PROBE),
        "readinessProbe": copy.deepcopy(READINESS_PROBE),
    }
    selector = stage_selector(pipe.base, pipe.index, index)
    labels = pipe.labels(selector)
    template_annotations = {"inferencemesh.io/layers": f"{stage.layer_start}:{stage.layer_end}",
                            **metrics_annotations(spec, STAGE_METRICS_PORT),
                            **tls_annotation(certificates, name)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, pipe.namespace, labels),
        "spec": {
            "replicas": 1,
            # One GPU-sized pod per stage: never run the old and the new side by side.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": template_annotations},
                "spec": pod_spec(spec, container, volumes, node_selector=spec.stages.node_selector,
                                  tolerations=spec.stages.tolerations, affinity=spec.stages.affinity),
            },
        },
    }


def render_stage_service(spec: MeshSpec, pipe: PipelineRef, index: int) -> dict:
    ports = [{"name": "grpc", "port": STAGE_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"}]
    if spec.metrics:
        ports.append({"name": "metrics", "port": STAGE_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"})
    selector = stage_selector(pipe.base, pipe.index, index)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(stage_name(pipe.prefix, index), pipe.namespace, pipe.labels(selector)),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    }


def render_stage_network_policy(spec: MeshSpec, plan: Plan, pipe: PipelineRef, index: int) -> dict:
    """Stage i accepts gRPC only from its own pipeline's frontend and stage i-1 (for stage 1 of an
    embedded first stage, the frontend is stage 0); metrics stay open to scrapers."""
    peers = [{"podSelector": {"matchLabels": frontend_selector(pipe.base, pipe.index)}}]
    if index > 0 and not (index == 1 and plan.embedded_first_stage):
        peers.append({"podSelector": {"matchLabels": stage_selector(pipe.base, pipe.index, index - 1)}})
    ingress = [{"from": peers, "ports": [{"protocol": "TCP", "port": STAGE_GRPC_PORT}]}]
    if spec.metrics:
        ingress.append({"ports": [{"protocol": "TCP", "port": STAGE_METRICS_PORT}]})
    selector = stage_selector(pipe.base, pipe.index, index)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(stage_name(pipe.prefix, index), pipe.namespace, pipe.labels(selector)),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
