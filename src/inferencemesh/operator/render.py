"""Pure rendering: an InferenceMesh and its plan -> the child objects, as plain dicts.

No API calls here. reconcile.py compares what this returns with what exists and writes the
difference; unit tests (tests/operator/test_render.py) check these objects without a cluster.

Per mesh: ConfigMap <base>-plan; the router (Deployment, ServiceAccount, Role and RoleBinding
<base>-router: it may only watch EndpointSlices; PodDisruptionBudget <base>-router: one router pod
stays), the endpoint Service <base>-frontend (selecting the router), the headless Service
<base>-pipelines (every frontend; the router watches its endpoints) and the PodDisruptionBudget
<base>-pipelines over every pipeline's pods (an eviction never takes the last serving pipeline).
Per pipeline k (prefix <base>-p<k>, names.py): per stage i a Deployment + Service
<prefix>-stage-<i> and a NetworkPolicy <prefix>-stage-<i> (gRPC only from its own pipeline's frontend
and stage i-1); the frontend Deployment <prefix>-frontend. With operator-issued certificates (the
default), Secrets <base>-ca and <component>-tls per stage and frontend, rendered from the material
reconcile.py settled (issuing.py); each pod mounts its own and rolls when it changes. With
spec.frontend.embedFirstStage, stage 0 runs inside the frontend pod: no stage-0 objects, and the
frontend pod takes stage 0's resources and placement. All carry an owner reference to the mesh
(kopf.adopt), so deleting the mesh garbage-collects them. Which pipelines exist is pipelines.py's
decision; their names and labels come from names.py, their container resources from resources.py.

This module assembles the children; each kind of object has its renderer: the stages'
(render_stage.py), the frontend's (render_frontend.py), the mesh-wide ones (render_mesh.py), and
what every pod shares (render_pod.py).
"""

from __future__ import annotations

import kopf

from inferencemesh.operator.issuing import MeshCertificates
from inferencemesh.operator.names import HASH_ANNOTATION, base_name, frontend_name, stage_name
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.render_frontend import render_frontend_deployment
from inferencemesh.operator.render_mesh import (
    render_certificate_secrets,
    render_endpoint_service,
    render_pipelines_budget,
    render_pipelines_service,
    render_plan_configmap,
    render_router,
)
from inferencemesh.operator.render_pod import PipelineRef, RenderOptions, content_hash
from inferencemesh.operator.render_stage import (
    render_stage_deployment,
    render_stage_network_policy,
    render_stage_service,
)
from inferencemesh.operator.spec import MeshSpec


def render_pipeline(spec: MeshSpec, plan: Plan, pipe: PipelineRef, opts: RenderOptions,
                    certificates: MeshCertificates | None = None, running: bool = True) -> list[dict]:
    """One pipeline's objects: its stages (Deployment, Service, NetworkPolicy each) and its frontend."""
    children: list[dict] = []
    for i in plan.remote_stages:
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


def pipeline_components(plan: Plan, prefix: str) -> list[str]:
    """The components of a pipeline that get a certificate: its stage pods and its frontend."""
    return [stage_name(prefix, i) for i in plan.remote_stages] + [frontend_name(prefix)]


def certificate_subjects(namespace: str, components: list[str]) -> dict[str, list[str]]:
    """Each component with the DNS names its certificate carries: its Service's, short to fully
    qualified (clients dial <name>.<namespace>.svc)."""
    return {c: [c, f"{c}.{namespace}", f"{c}.{namespace}.svc", f"{c}.{namespace}.svc.cluster.local"]
            for c in components}


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
    children += [render_pipelines_service(base, ns), render_pipelines_budget(base, ns, spec),
                 *render_router(base, ns, spec, opts), render_endpoint_service(base, ns, spec)]
    kopf.adopt(children, owner=mesh)  # type: ignore[arg-type]  # kopf reads a plain dict as it reads its Body
    for child in children:
        child["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = content_hash(child)
    return children
