"""The names of a mesh's children and what they carry: object names, labels, selectors, annotation
keys, in-cluster addresses. One place, so the renderer, the status and the reconciler name things
alike (none of them imports another for a name).

A mesh runs spec.replicas pipelines, each a frontend and its own stage pods. Pipeline k's objects
are named from its own prefix, `<base>-p<k>` (`<base>-p1-stage-0`, `<base>-p1-frontend`), and carry
LABEL_PIPELINE=k and LABEL_REVISION (the hash of what the pipeline runs: a new revision replaces
pipelines one at a time). The mesh-wide objects keep the mesh's prefix: the router `<base>-router`,
the endpoint Service `<base>-frontend` (the name clients have always used; it selects the router),
the headless Service `<base>-pipelines` (every frontend: the router watches its endpoints).
"""

from __future__ import annotations

import hashlib
import re

from inferencemesh.config import STAGE_GRPC_PORT
from inferencemesh.operator.spec import MeshSpec

MANAGED_BY = "inferencemesh-operator"
LABEL_MESH = "inferencemesh.io/mesh"
LABEL_STAGE = "inferencemesh.io/stage"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PIPELINE = "inferencemesh.io/pipeline"
LABEL_REVISION = "inferencemesh.io/revision"
HASH_ANNOTATION = "inferencemesh.io/spec-hash"
# On the mesh: changing its value resets every pipeline's restart budget (and lifts a Failed pipeline).
RESET_RESTARTS_ANNOTATION = "inferencemesh.io/reset-restarts"
# On a pod template: a hash of the certificate and trust bundle it mounts, so a renewal rolls the pods
# (a process reads its certificate once, at start).
TLS_HASH_ANNOTATION = "inferencemesh.io/tls-hash"

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_BASE_MAX = 40  # leaves room for "-p63-stage-63" / "-pipelines" within a 63-character Service name


def base_name(mesh_name: str) -> str:
    """A DNS-1035 prefix for child names and label values, stable for a given mesh name.

    A mesh may be named like any DNS subdomain (253 characters, dots, a leading digit); Service
    names and label values may not, so such names are folded and suffixed with a short hash.
    """
    if len(mesh_name) <= _BASE_MAX and _DNS1035.fullmatch(mesh_name):
        return mesh_name
    folded = re.sub(r"[^a-z0-9-]+", "-", mesh_name.lower()).strip("-")
    if not folded or not folded[0].isalpha():
        folded = "m-" + folded
    digest = hashlib.sha256(mesh_name.encode()).hexdigest()[:8]
    return f"{folded[:_BASE_MAX - 9].rstrip('-')}-{digest}"

def pipeline_prefix(base: str, pipeline: int) -> str:
    """The prefix of pipeline `pipeline`'s objects (what stage_name and frontend_name take)."""
    return f"{base}-p{pipeline}"

def stage_name(prefix: str, index: int) -> str:
    return f"{prefix}-stage-{index}"

def frontend_name(prefix: str) -> str:
    return f"{prefix}-frontend"

def endpoint_service_name(base: str) -> str:
    """The mesh's OpenAI endpoint (it selects the router's pods)."""
    return f"{base}-frontend"

def router_name(base: str) -> str:
    return f"{base}-router"

def pipelines_service_name(base: str) -> str:
    """The headless Service over every frontend of the mesh, whose endpoints the router watches."""
    return f"{base}-pipelines"

def plan_name(base: str) -> str:
    return f"{base}-plan"

def ca_secret_name(base: str) -> str:
    return f"{base}-ca"

def tls_secret_name(component: str) -> str:
    """The Secret with a stage's or the frontend's certificate (component: its Deployment's name)."""
    return f"{component}-tls"

def mesh_labels(base: str) -> dict[str, str]:
    """Labels every child carries; the operator finds its children with LABEL_MESH."""
    return {
        "app.kubernetes.io/name": "inferencemesh",
        "app.kubernetes.io/instance": base,
        "app.kubernetes.io/part-of": "inferencemesh",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MESH: base,
    }

def stage_selector(base: str, pipeline: int, index: int) -> dict[str, str]:
    return {LABEL_MESH: base, LABEL_COMPONENT: "stage", LABEL_PIPELINE: str(pipeline), LABEL_STAGE: str(index)}

def frontend_selector(base: str, pipeline: int) -> dict[str, str]:
    return {LABEL_MESH: base, LABEL_COMPONENT: "frontend", LABEL_PIPELINE: str(pipeline)}

def frontends_selector(base: str) -> dict[str, str]:
    """Every frontend of the mesh: one pod per pipeline (the /scale subresource's selector)."""
    return {LABEL_MESH: base, LABEL_COMPONENT: "frontend"}

def router_selector(base: str) -> dict[str, str]:
    return {LABEL_MESH: base, LABEL_COMPONENT: "router"}

def selector_text(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())

def stage_address(prefix: str, namespace: str, index: int) -> str:
    return f"{stage_name(prefix, index)}.{namespace}.svc:{STAGE_GRPC_PORT}"

def endpoint_url(base: str, namespace: str, spec: MeshSpec) -> str:
    return f"http://{endpoint_service_name(base)}.{namespace}.svc:{spec.frontend.service_port}/v1"
