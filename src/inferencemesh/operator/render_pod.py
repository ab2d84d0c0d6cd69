"""What every pod of a mesh shares, for the renderers of its objects (render_stage.py,
render_frontend.py, render_mesh.py): the render options, the model, runtime and stream settings,
volumes and environment, the pod spec's security settings, metadata, and where a pipeline's
objects live (PipelineRef). Pure: no API calls.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from inferencemesh.bundled import served_name
from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import (
    LABEL_REVISION,
    TLS_HASH_ANNOTATION,
    mesh_labels,
    pipeline_prefix,
    tls_secret_name,
)
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.resources import stage_threads
from inferencemesh.operator.spec import MeshSpec

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


def served_model_name(spec: MeshSpec) -> str:
    return served_name(spec.model.name, spec.model.served_model_name)


def content_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def shared_options(spec: MeshSpec, plan: Plan) -> dict:
    """The model, runtime and stream settings every pod of the mesh gets (config.ModelOptions,
    config.RuntimeOptions and config.StreamOptions fields)."""
    model = spec.model
    if model.pvc_claim:
        source, revision = f"{MODELS_MOUNT}/{model.pvc_sub_path.strip('/')}".rstrip("/"), None
    else:
        source, revision = model.name, model.revision or None
    options = {
        "model": source, "revision": revision, "dtype": model.dtype, "cache_dir": f"{CACHE_MOUNT}/hub",
        "quantization": model.quantization,  # every stage, the embedded one too, quantizes as the plan counted
        "served_model_name": served_model_name(spec),  # every pod's metrics carry the name clients use
        "max_context": spec.context_length, "max_sessions": spec.max_sessions,
        "kv_cache_tokens": spec.kv_cache_tokens, "wire_dtype": spec.wire_dtype or None,
        "debug_telemetry": spec.debug_tracing, "tls_dir": TLS_MOUNT if spec.tls else None,
        "max_message_bytes": plan.message_limit,  # both ends of every stage stream
    }
    return options


def _tls_secret(spec: MeshSpec, component: str) -> str | None:
    """The Secret a component's pod mounts at TLS_MOUNT: the user's own, else the operator's for it."""
    if spec.mtls_secret:
        return spec.mtls_secret
    return tls_secret_name(component) if spec.issues_certificates else None


def pod_volumes(spec: MeshSpec, component: str) -> tuple[list[dict], list[dict]]:
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


POD_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
    {"name": "XDG_CACHE_HOME", "value": f"{CACHE_MOUNT}/xdg"},
    {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_MOUNT}/inductor"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
]

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod_spec(spec: MeshSpec, container: dict, volumes: list[dict], *, node_selector: dict,
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


def metrics_annotations(spec: MeshSpec, port: int) -> dict[str, str]:
    if not spec.metrics:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def tls_annotation(certificates: MeshCertificates | None, component: str) -> dict[str, str]:
    leaf = certificates.leaves[component] if certificates else None
    return {TLS_HASH_ANNOTATION: hashlib.sha256(leaf.cert + leaf.ca).hexdigest()[:20]} if leaf else {}


def object_meta(name: str, namespace: str, labels: dict[str, str], annotations: dict | None = None) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


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


def stage_compute(spec: MeshSpec, *, shares_pod: bool = False) -> dict:
    """How a stage computes (StageConfig fields, and FrontendConfig's for the embedded first stage)."""
    return {"device": spec.stages.device, "threads": stage_threads(spec, shares_pod=shares_pod)}
