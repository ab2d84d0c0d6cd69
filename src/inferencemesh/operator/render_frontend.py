"""A pipeline's frontend Deployment: its arguments, its container and where its pod runs (with an
embedded first stage, stage 0's place). Pure: no API calls.
"""

from __future__ import annotations

import copy
from typing import Any

from inferencemesh.config import API_KEY_ENV, FRONTEND_PORT, FrontendConfig
from inferencemesh.flags import to_argv
from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import frontend_name, frontend_selector, stage_address
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
from inferencemesh.operator.resources import stage_resources, sum_resources
from inferencemesh.operator.spec import MeshSpec


def frontend_grace_seconds(spec: MeshSpec) -> int:
    """A leaving frontend's whole life after the kubelet's stop: the preStop wait, the drain, a margin."""
    return spec.frontend.pre_stop_seconds + spec.frontend.drain_timeout_seconds + 10


def frontend_args(spec: MeshSpec, plan: Plan, pipe: PipelineRef) -> list[str]:
    sp = spec.speculative
    first = plan.stages[0]
    embedded: dict[str, Any] = (
        {"first_stage_layers": (first.layer_start, first.layer_end), **stage_compute(spec, shares_pod=True)}
        if plan.embedded_first_stage else {})
    under_load: dict[str, Any] = ({} if sp.disable_by_batch_size is None
                                  else {"speculative_disable_by_batch_size": sp.disable_by_batch_size})
    config = FrontendConfig(
        **shared_options(spec, plan),
        stage_addresses=tuple(stage_address(pipe.prefix, pipe.namespace, i) for i in plan.remote_stages),
        port=FRONTEND_PORT, api_key_env=API_KEY_ENV, max_batch_tokens=spec.max_batch_tokens,
        prefix_cache=spec.prefix_cache, drain_timeout=float(spec.frontend.drain_timeout_seconds), **embedded,
        # Unset strategy stays unset: the frontend then runs the model package's declared default.
        speculative=sp.strategy, draft=sp.draft, no_draft=sp.no_draft, window=sp.window.flag() if sp.window else None,
        **under_load,
    ).check()
    return ["frontend", *to_argv(config)]


def api_key_env(spec: MeshSpec) -> list[dict[str, Any]]:
    """API_KEY_ENV from spec.frontend.apiKeySecret (none without one): the frontends check the key,
    the router presents it on its own requests to them (their /kv/* routes are authenticated)."""
    if not spec.frontend.api_key_secret:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": spec.frontend.api_key_secret, "key": spec.frontend.api_key_key}}}]


def _frontend_container(spec: MeshSpec, plan: Plan, pipe: PipelineRef, opts: RenderOptions,
                        mounts: list[dict]) -> dict:
    env: list[dict[str, Any]] = [*copy.deepcopy(POD_ENV), *api_key_env(spec)]
    embedded = plan.embedded_first_stage
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container = {
        "name": "frontend",
        "image": spec.images.frontend or opts.frontend_image,
        "imagePullPolicy": spec.images.pull_policy,
        "args": frontend_args(spec, plan, pipe),
        "env": env,
        "ports": [{"name": "http", "containerPort": FRONTEND_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # The embedded first stage's pod does stage 0's work and the frontend's.
        "resources": (sum_resources(stage_resources(spec), spec.frontend.resources) if embedded
                      else copy.deepcopy(spec.frontend.resources)),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        # A loaded 2-core node answers slowly (a probe's default 1 s timeout is short there), and the
        # embedded stage's work shares the process: liveness restarts only a frontend silent for 2 minutes.
        "startupProbe": {**health, "timeoutSeconds": 5,
                         **(LAYERS_STARTUP_PROBE if embedded else {"periodSeconds": 5, "failureThreshold": 120})},
        "livenessProbe": {**health, "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 6},
        # /ready is true only while every stage answers SERVING, and false once the pod drains: 3 s
        # before a probe counts as failed, three failures in a row to turn unready.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 3,
                           "timeoutSeconds": 3},
    }
    if spec.frontend.pre_stop_seconds:
        # Endpoints and the router forget a terminating pod within this; then SIGTERM starts the drain.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(spec.frontend.pre_stop_seconds)]}}}
    return container


def _frontend_placement(spec: MeshSpec, plan: Plan) -> dict[str, Any]:
    """pod_spec's placement: with an embedded first stage, stage 0's hardware (both nodeSelectors;
    spec.validate refuses a key they disagree on)."""
    if plan.embedded_first_stage:
        return {"node_selector": {**spec.frontend.node_selector, **spec.stages.node_selector},
                "tolerations": (*spec.stages.tolerations, *spec.frontend.tolerations),
                "affinity": spec.stages.affinity}
    return {"node_selector": spec.frontend.node_selector, "tolerations": spec.frontend.tolerations, "affinity": None}


def render_frontend_deployment(spec: MeshSpec, plan: Plan, pipe: PipelineRef, opts: RenderOptions,
                               certificates: MeshCertificates | None = None, running: bool = True) -> dict:
    """running False: a Failed pipeline's frontend, scaled to zero so that nothing routes to it."""
    name = frontend_name(pipe.prefix)
    # the model claim too: an embedded first stage loads its layers here
    volumes, mounts = pod_volumes(spec, name)
    container = _frontend_container(spec, plan, pipe, opts, mounts)
    selector = frontend_selector(pipe.base, pipe.index)
    labels = pipe.labels(selector)
    annotations = {**metrics_annotations(spec, FRONTEND_PORT), **tls_annotation(certificates, name)}
    if plan.embedded_first_stage:
        annotations["inferencemesh.io/layers"] = f"{plan.stages[0].layer_start}:{plan.stages[0].layer_end}"
    # A pod holding a GPU never surges: a spare GPU for the new pod rarely exists, and the rollout would stall.
    holds_gpu = plan.embedded_first_stage and spec.stages.gpus > 0
    rolling = {"maxUnavailable": 1, "maxSurge": 0} if holds_gpu else {"maxUnavailable": 0, "maxSurge": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, pipe.namespace, labels),
        "spec": {
            "replicas": 1 if running else 0,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": pod_spec(spec, container, volumes, **_frontend_placement(spec, plan),
                                 grace_seconds=frontend_grace_seconds(spec)),
            },
        },
    }
