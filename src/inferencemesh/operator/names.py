"""The names of a mesh's children and what they carry: object names, labels, selectors, annotation
keys, in-cluster addresses. One place, so the renderer, the status and the reconciler name things
alike (none of them imports another for a name).
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
HASH_ANNOTATION = "inferencemesh.io/spec-hash"
# On a pod template: a hash of the certificate and trust bundle it mounts, so a renewal rolls the pods
# (a process reads its certificate once, at start).
TLS_HASH_ANNOTATION = "inferencemesh.io/tls-hash"

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_BASE_MAX = 40  # leaves room for "-stage-63" / "-frontend" within a 63-character Service name


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

def stage_name(base: str, index: int) -> str:
    return f"{base}-stage-{index}"

def frontend_name(base: str) -> str:
    return f"{base}-frontend"

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

def stage_selector(base: str, index: int) -> dict[str, str]:
    return {LABEL_MESH: base, LABEL_COMPONENT: "stage", LABEL_STAGE: str(index)}

def frontend_selector(base: str) -> dict[str, str]:
    return {LABEL_MESH: base, LABEL_COMPONENT: "frontend"}

def stage_address(base: str, namespace: str, index: int) -> str:
    return f"{stage_name(base, index)}.{namespace}.svc:{STAGE_GRPC_PORT}"

def endpoint_url(base: str, namespace: str, spec: MeshSpec) -> str:
    return f"http://{frontend_name(base)}.{namespace}.svc:{spec.frontend.service_port}/v1"

def frontend_metrics_url(base: str, namespace: str, spec: MeshSpec) -> str:
    return f"http://{frontend_name(base)}.{namespace}.svc:{spec.frontend.service_port}/metrics"
