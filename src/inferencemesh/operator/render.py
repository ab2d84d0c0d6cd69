"""Pure rendering: an InferenceMesh and its plan -> the child objects, as plain dicts.

No API calls here. reconcile.py compares what this returns with what exists and writes the
difference; unit tests (tests/operator/test_render.py) check these objects without a cluster.

Per mesh: ConfigMap <base>-plan; the router (Deployment, ServiceAccount, Role and RoleBinding
<base>-router: it may only watch EndpointSlices), the endpoint Service <base>-frontend (selecting
the router) and the headless Service <base>-pipelines (every frontend; the router watches its
endpoints). Per pipeline k (prefix <base>-p<k>, names.py): per stage i a Deployment + Service
<prefix>-stage-<i> and a NetworkPolicy <prefix>-stage-<i> (gRPC only from its own pipeline's frontend
and stage i-1); the frontend Deployment <prefix>-frontend. With operator-issued certificates (the
default), Secrets <base>-ca and <component>-tls per stage and frontend, rendered from the material
reconcile.py settled (issuing.py); each pod mounts its own and rolls when it changes. With
spec.frontend.embedFirstStage, stage 0 runs inside the frontend pod: no stage-0 objects, and the
frontend pod takes stage 0's resources and placement. All carry an owner reference to the mesh
(kopf.adopt), so deleting the mesh garbage-collects them. Which pipelines exist is pipelines.py's
decision; their names and labels come from names.py, their container resources from resources.py.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import kopf

from inferencemesh.bundled import served_name
from inferencemesh.config import (
    API_KEY_ENV,
    FRONTEND_PORT,
    STAGE_GRPC_PORT,
    STAGE_METRICS_PORT,
    FrontendConfig,
    RouterConfig,
    StageConfig,
)
from inferencemesh.flags import to_argv
from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import (
    HASH_ANNOTATION,
    LABEL_COMPONENT,
    LABEL_REVISION,
    TLS_HASH_ANNOTATION,
    base_name,
    ca_secret_name,
    endpoint_service_name,
    frontend_name,
    frontend_selector,
    frontends_selector,
    mesh_labels,
    pipeline_prefix,
    pipelines_service_name,
    plan_name,
    router_name,
    router_selector,
    stage_address,
    stage_name,
    stage_selector,
    tls_secret_name,
)
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.resources import stage_resources, stage_threads, sum_resources
from inferencemesh.operator.spec import MeshSpec
from inferencemesh.planner import render_plan
from inferencemesh.tls import stage_peers

MODELS_MOUNT = "/models"
TLS_MOUNT = "/etc/inferencemesh/tls"  # the mTLS Secret: tls.crt, tls.key, ca.crt
CACHE_MOUNT = "/cache"
DEFAULT_STAGE_IMAGE = "ghcr.io/inferencemesh/stage:0.1.0"
DEFAULT_FRONTEND_IMAGE = "ghcr.io/inferencemesh/frontend:0.1.0"

# Loading a large range can take minutes: a pod that loads layers holds liveness off this long (30 min).
LAYERS_STARTUP_PROBE = {"periodSeconds": 10, "failureThreshold": 180}

@dataclass(frozen=True)
class RenderOptions:
    stage_image: str = DEFAULT_STAGE_IMAGE
    frontend_image: str = DEFAULT_FRONTEND_IMAGE
    grpc_probes: bool = True  # native gRPC probes need Kubernetes >= 1.24; else an exec probe


def served_model_name(spec: MeshSpec) -> str:
    return served_name(spec.model.name, spec.model.served_model_name)


def content_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


# ---- pieces shared by both pod templates ---------------------------------------------------

def _shared_options(spec: MeshSpec, plan: Plan) -> dict:
    """The model, runtime and stream settings every pod of the mesh gets (config.ModelOptions,
    config.RuntimeOptions and config.StreamOptions fields)."""
    model = spec.model
    if model.pvc_claim:
        source, revision = f"{MODELS_MOUNT}/{model.pvc_sub_path.strip('/')}".rstrip("/"), None
    else:
        source, revision = model.name, model.revision or None
    options = {
        "model": source, "revision": revision, "dtype": model.dtype, "cache_dir": f"{CACHE_MOUNT}/hub",
        "served_model_name": served_model_name(spec),  # every pod's metrics carry the name clients use
        "max_context": spec.context_length, "max_sessions": spec.max_sessions,
        "prefix_cache_tokens": spec.prefix_cache_tokens, "wire_dtype": spec.wire_dtype or None,
        "debug_telemetry": spec.debug_tracing, "tls_dir": TLS_MOUNT if spec.tls else None,
        "max_message_bytes": plan.message_limit,  # both ends of every stage stream
    }
    return options


def _tls_secret(spec: MeshSpec, component: str) -> str | None:
    """The Secret a component's pod mounts at TLS_MOUNT: the user's own, else the operator's for it."""
    if spec.mtls_secret:
        return spec.mtls_secret
    return tls_secret_name(component) if spec.issues_certificates else None


def _volumes(spec: MeshSpec, component: str) -> tuple[list[dict], list[dict]]:
    """emptyDirs for the caches (the root filesystem is read-only), the model claim if any, and the
    component's TLS Secret if the mesh uses mutual TLS."""
    volumes: list[dict] = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict] = [{"name": "cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.pvc_claim:
        claim = {"claimName": spec.model.pvc_claim, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODELS_MOUNT, "readOnly": True})
    secret = _tls_secret(spec, component)
    if secret:
        # World-readable inside the container: Secret files are root's, the image runs as uid 10001, and
        # an fsGroup would also chown the model claim. The container runs nothing else.
        volumes.append({"name": "tls", "secret": {"secretName": secret, "defaultMode": 0o444}})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
    return volumes, mounts


_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
    {"name": "XDG_CACHE_HOME", "value": f"{CACHE_MOUNT}/xdg"},
    {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_MOUNT}/inductor"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
]

_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_spec(spec: MeshSpec, container: dict, volumes: list[dict], *, node_selector: dict,
              tolerations: tuple, affinity: dict | None, grace_seconds: int = 30) -> dict:
    # A crash's own one-line reason (the CLI writes it to the termination log), else the log's tail:
    # what status.pipelines quotes when a pipeline runs out of restarts.
    container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    pod: dict = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,  # the data plane never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_seconds,
    }
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    if affinity:
        pod["affinity"] = copy.deepcopy(affinity)
    if spec.images.pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    return pod


def _metrics_annotations(spec: MeshSpec, port: int) -> dict[str, str]:
    if not spec.metrics:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _grpc_probe(spec: MeshSpec, opts: RenderOptions, server_name: str, **timing: int) -> dict:
    if opts.grpc_probes and not spec.tls:
        return {"grpc": {"port": STAGE_GRPC_PORT}, **timing}
    # Older clusters, or mutual TLS (the kubelet's gRPC probe presents no client certificate):
    # the same grpc.health.v1 check from inside the container.
    command = ["python", "-m", "inferencemesh.stage.healthprobe", f"127.0.0.1:{STAGE_GRPC_PORT}"]
    if spec.tls:  # the certificate names the stage's Service, not 127.0.0.1
        command += ["--tls-dir", TLS_MOUNT, "--server-name", server_name]
    return {"exec": {"command": command}, **timing}


def _tls_annotation(certificates: MeshCertificates | None, component: str) -> dict[str, str]:
    leaf = certificates.leaves[component] if certificates else None
    return {TLS_HASH_ANNOTATION: hashlib.sha256(leaf.cert + leaf.ca).hexdigest()[:20]} if leaf else {}


def _meta(name: str, namespace: str, labels: dict[str, str], annotations: dict | None = None) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


# ---- the children --------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineRef:
    """One pipeline of a mesh: where its objects live, how they are named, the revision they run."""

    base: str
    namespace: str
    index: int
    revision: str = ""

    @property
    def prefix(self) -> str:
        return pipeline_prefix(self.base, self.index)

    def labels(self, selector: dict[str, str]) -> dict[str, str]:
        """A child's labels: the mesh's, its selector, and the revision (outside every selector)."""
        return {**mesh_labels(self.base), **selector, **({LABEL_REVISION: self.revision} if self.revision else {})}


def _stage_compute(spec: MeshSpec, *, shares_pod: bool = False) -> dict:
    """How a stage computes (StageConfig fields, and FrontendConfig's for the embedded first stage)."""
    return {"device": spec.stages.device, "threads": stage_threads(spec, shares_pod=shares_pod)}


def frontend_grace_seconds(spec: MeshSpec) -> int:
    """A leaving frontend's whole life after the kubelet's stop: the preStop wait, the drain, a margin."""
    return spec.frontend.pre_stop_seconds + spec.frontend.drain_timeout_seconds + 10


def render_stage_deployment(spec: MeshSpec, plan: Plan, pipe: PipelineRef, index: int, opts: RenderOptions,
                            certificates: MeshCertificates | None = None) -> dict:
    stage = plan.stages[index]
    n = len(plan.stages)
    name = stage_name(pipe.prefix, index)
    config = StageConfig(
        **_shared_options(spec, plan), layers=(stage.layer_start, stage.layer_end), stage_index=index, num_stages=n,
        port=STAGE_GRPC_PORT, metrics_port=STAGE_METRICS_PORT if spec.metrics else 0,
        downstream=stage_address(pipe.prefix, pipe.namespace, index + 1) if index + 1 < n else None,
        **_stage_compute(spec),
        # Certificates the operator issues name their component: only its pipeline's frontend and
        # the stage before may call (a Secret of the user's names nobody we know).
        peers=stage_peers(index, remote_stages(plan)[0], frontend_name(pipe.prefix), partial(stage_name, pipe.prefix))
        if spec.issues_certificates else (),
    ).check()
    args = ["stage", *to_argv(config)]
    resources = stage_resources(spec)
    ports = [{"name": "grpc", "containerPort": STAGE_GRPC_PORT, "protocol": "TCP"}]
    if spec.metrics:
        ports.append({"name": "metrics", "containerPort": STAGE_METRICS_PORT, "protocol": "TCP"})
    volumes, mounts = _volumes(spec, name)
    container = {
        "name": "stage",
        "image": spec.images.stage or opts.stage_image,
        "imagePullPolicy": spec.images.pull_policy,
        "args": args,
        "env": copy.deepcopy(_ENV),
        "ports": ports,
        "volumeMounts": mounts,
        "resources": resources,
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        "startupProbe": {"tcpSocket": {"port": STAGE_GRPC_PORT}, **LAYERS_STARTUP_PROBE},
        "livenessProbe": {"tcpSocket": {"port": STAGE_GRPC_PORT}, "periodSeconds": 20, "failureThreshold": 3},
        "readinessProbe": _grpc_probe(spec, opts, stage_address(pipe.prefix, pipe.namespace, index).rsplit(":", 1)[0],
                                      periodSeconds=5, failureThreshold=2),
    }
    selector = stage_selector(pipe.base, pipe.index, index)
    labels = pipe.labels(selector)
    template_annotations = {"inferencemesh.io/layers": f"{stage.layer_start}:{stage.layer_end}",
                            **_metrics_annotations(spec, STAGE_METRICS_PORT),
                            **_tls_annotation(certificates, name)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, pipe.namespace, labels),
        "spec": {
            "replicas": 1,
            # One GPU-sized pod per stage: never run the old and the new side by side.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": template_annotations},
                "spec": _pod_spec(spec, container, volumes, node_selector=spec.stages.node_selector,
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
        "metadata": _meta(stage_name(pipe.prefix, index), pipe.namespace, pipe.labels(selector)),
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
        "metadata": _meta(stage_name(pipe.prefix, index), pipe.namespace, pipe.labels(selector)),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def remote_stages(plan: Plan) -> range:
    """The indexes of the stages that run as stage pods: all but an embedded first stage."""
    return range(1 if plan.embedded_first_stage else 0, len(plan.stages))


def frontend_args(spec: MeshSpec, plan: Plan, pipe: PipelineRef) -> list[str]:
    sp = spec.speculative
    first = plan.stages[0]
    embedded: dict[str, Any] = (
        {"first_stage_layers": (first.layer_start, first.layer_end), **_stage_compute(spec, shares_pod=True)}
        if plan.embedded_first_stage else {})
    under_load: dict[str, Any] = ({} if sp.disable_by_batch_size is None
                                  else {"speculative_disable_by_batch_size": sp.disable_by_batch_size})
    config = FrontendConfig(
        **_shared_options(spec, plan),
        stage_addresses=tuple(stage_address(pipe.prefix, pipe.namespace, i) for i in remote_stages(plan)),
        port=FRONTEND_PORT, api_key_env=API_KEY_ENV, max_batch_tokens=spec.max_batch_tokens,
        prefix_cache=spec.prefix_cache, drain_timeout=float(spec.frontend.drain_timeout_seconds), **embedded,
        # Unset strategy stays unset: the frontend then runs the model package's declared default.
        speculative=sp.strategy, draft=sp.draft, no_draft=sp.no_draft, window=sp.window.flag() if sp.window else None,
        **under_load,
    ).check()
    return ["frontend", *to_argv(config)]




def render_frontend_deployment(spec: MeshSpec, plan: Plan, pipe: PipelineRef, opts: RenderOptions,
                               certificates: MeshCertificates | None = None, running: bool = True) -> dict:
    """running False: a Failed pipeline's frontend, scaled to zero so that nothing routes to it."""
    name = frontend_name(pipe.prefix)
    env: list[dict[str, Any]] = copy.deepcopy(_ENV)
    if spec.frontend.api_key_secret:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.frontend.api_key_secret, "key": spec.frontend.api_key_key}}})
    # the model claim too: an embedded first stage loads its layers here
    volumes, mounts = _volumes(spec, name)
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
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        "startupProbe": {**health, **(LAYERS_STARTUP_PROBE if embedded else {"periodSeconds": 5,
                                                                            "failureThreshold": 120})},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        # /ready is true only while every stage answers SERVING, and false once the pod drains. A
        # busy node answers slowly: 3 s before a probe counts as failed, two failures to turn unready.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 2,
                           "timeoutSeconds": 3},
    }
    if spec.frontend.pre_stop_seconds:
        # Endpoints and the router forget a terminating pod within this; then SIGTERM starts the drain.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(spec.frontend.pre_stop_seconds)]}}}
    selector = frontend_selector(pipe.base, pipe.index)
    labels = pipe.labels(selector)
    annotations = {**_metrics_annotations(spec, FRONTEND_PORT), **_tls_annotation(certificates, name)}
    if embedded:
        annotations["inferencemesh.io/layers"] = f"{plan.stages[0].layer_start}:{plan.stages[0].layer_end}"
        # Stage 0's place: its hardware (both nodeSelectors; spec.validate refuses a key they disagree on).
        placement: dict[str, Any] = {"node_selector": {**spec.frontend.node_selector, **spec.stages.node_selector},
                     "tolerations": (*spec.stages.tolerations, *spec.frontend.tolerations),
                     "affinity": spec.stages.affinity}
    else:
        placement = {"node_selector": spec.frontend.node_selector, "tolerations": spec.frontend.tolerations,
                     "affinity": None}
    # A pod holding a GPU never surges: a spare GPU for the new pod rarely exists, and the rollout would stall.
    holds_gpu = embedded and spec.stages.gpus > 0
    rolling = {"maxUnavailable": 1, "maxSurge": 0} if holds_gpu else {"maxUnavailable": 0, "maxSurge": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, pipe.namespace, labels),
        "spec": {
            "replicas": 1 if running else 0,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": _pod_spec(spec, container, volumes, **placement, grace_seconds=frontend_grace_seconds(spec)),
            },
        },
    }


def render_pipeline(spec: MeshSpec, plan: Plan, pipe: PipelineRef, opts: RenderOptions,
                    certificates: MeshCertificates | None = None, running: bool = True) -> list[dict]:
    """One pipeline's objects: its stages (Deployment, Service, NetworkPolicy each) and its frontend."""
    children: list[dict] = []
    for i in remote_stages(plan):
        children += [render_stage_deployment(spec, plan, pipe, i, opts, certificates),
                     render_stage_service(spec, pipe, i),
                     render_stage_network_policy(spec, plan, pipe, i)]
    children.append(render_frontend_deployment(spec, plan, pipe, opts, certificates, running))
    return children


def pipeline_revision(mesh: dict, spec: MeshSpec, plan: Plan, opts: RenderOptions) -> str:
    """What a pipeline runs, as a hash: its objects as pipeline 0 renders them, without the certificates
    (a renewal rolls pods in place; a new model, image, plan or setting is a new revision)."""
    pipe = PipelineRef(base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"], 0)
    return content_hash({"pipeline": render_pipeline(spec, plan, pipe, opts)})[:10]


def render_endpoint_service(base: str, namespace: str, spec: MeshSpec) -> dict:
    """The mesh's OpenAI endpoint: the router's pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(endpoint_service_name(base), namespace, {**mesh_labels(base), **router_selector(base)}),
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
        "metadata": _meta(pipelines_service_name(base), namespace,
                          {**mesh_labels(base), LABEL_COMPONENT: "pipelines"}),
        "spec": {
            "clusterIP": "None",
            "selector": frontends_selector(base),
            "ports": [{"name": "http", "port": FRONTEND_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_router(base: str, namespace: str, spec: MeshSpec, opts: RenderOptions) -> list[dict]:
    """The router's Deployment and the least privilege it needs: its own ServiceAccount, allowed to
    read and watch EndpointSlices in the mesh's namespace, nothing else."""
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
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "http", "containerPort": FRONTEND_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "resources": copy.deepcopy(spec.router.resources),
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        # A loaded node starts Python slowly, and a probe's default 1 s is short there (the cluster
        # tests saw the kubelet kill a router mid-rollout on liveness timeouts).
        "startupProbe": {**health, "periodSeconds": 2, "failureThreshold": 90, "timeoutSeconds": 3},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
        # Ready once a pipeline is: before that the endpoint has nothing to serve with.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 2,
                           "timeoutSeconds": 3},
    }
    pod = _pod_spec(spec, container, [{"name": "tmp", "emptyDir": {}}], node_selector=spec.router.node_selector,
                    tolerations=spec.router.tolerations, affinity=None)
    pod["serviceAccountName"] = name
    pod["automountServiceAccountToken"] = True  # it watches the pipelines' endpoints
    meta = _meta(name, namespace, labels)
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
                "template": {"metadata": {"labels": labels, "annotations": _metrics_annotations(spec, FRONTEND_PORT)},
                             "spec": pod},
            },
        },
    ]


def render_plan_configmap(mesh: dict, spec: MeshSpec, plan: Plan) -> dict:
    base, ns = base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"]
    doc = {"model": spec.model.name, "planHash": plan.hash, **plan.to_dict()}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan_name(base), ns, {**mesh_labels(base), LABEL_COMPONENT: "plan"}),
        "data": {
            "plan.json": json.dumps(doc, indent=2, sort_keys=True) + "\n",
            "plan.txt": render_plan(list(plan.stages)) + "\n",
        },
    }


def pipeline_components(plan: Plan, prefix: str) -> list[str]:
    """The components of a pipeline that get a certificate: its stage pods and its frontend."""
    return [stage_name(prefix, i) for i in remote_stages(plan)] + [frontend_name(prefix)]


def certificate_subjects(namespace: str, components: list[str]) -> dict[str, list[str]]:
    """Each component with the DNS names its certificate carries: its Service's, short to fully
    qualified (clients dial <name>.<namespace>.svc)."""
    return {c: [c, f"{c}.{namespace}", f"{c}.{namespace}.svc", f"{c}.{namespace}.svc.cluster.local"]
            for c in components}


def _secret(mesh: dict, name: str, secret_type: str, data: dict[str, bytes], component: str) -> dict:
    base, ns = base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(name, ns, {**mesh_labels(base), LABEL_COMPONENT: component}),
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


def render_children(mesh: dict, spec: MeshSpec, plan: Plan, opts: RenderOptions,
                    certificates: MeshCertificates | None = None, pipelines: dict[int, bool] | None = None,
                    revision: str | None = None) -> list[dict]:
    """Every child of the mesh the operator converges, owned by it and stamped with a hash of its own
    content: the mesh-wide objects and the current revision's pipelines (index -> its frontend runs;
    default: pipelines 0..spec.replicas-1, all running). certificates: the mesh's own
    (issuing.settle), required when the spec has the operator issue them."""
    if spec.issues_certificates != (certificates is not None):
        raise ValueError("certificates must be given exactly when the operator issues the mesh's certificates")
    base, ns = base_name(mesh["metadata"]["name"]), mesh["metadata"]["namespace"]
    if pipelines is None:
        pipelines = dict.fromkeys(range(spec.replicas), True)
    revision = revision if revision is not None else pipeline_revision(mesh, spec, plan, opts)
    # The Secrets first: a pod that mounts one waits for it, and a reconcile that stops at a refused
    # child has still stored the certificates it issued (else the next one would issue others, and so on).
    children = render_certificate_secrets(mesh, certificates) if certificates is not None else []
    children.append(render_plan_configmap(mesh, spec, plan))
    for index, running in sorted(pipelines.items()):
        children += render_pipeline(spec, plan, PipelineRef(base, ns, index, revision), opts, certificates, running)
    children += [render_pipelines_service(base, ns), *render_router(base, ns, spec, opts),
                 render_endpoint_service(base, ns, spec)]
    kopf.adopt(children, owner=mesh)  # type: ignore[arg-type]  # kopf reads a plain dict as it reads its Body
    for child in children:
        child["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = content_hash(child)
    return children
