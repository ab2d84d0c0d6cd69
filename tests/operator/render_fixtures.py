"""What the rendering tests share: a mesh, plans and certificates for it, and its rendered children."""

from __future__ import annotations

import datetime
import functools

from inferencemesh.operator import render as R
from inferencemesh.operator import render_pod as P
from inferencemesh.operator.issuing import MeshCertificates, settle
from inferencemesh.operator.planning import Plan, SpeculativeChoice
from inferencemesh.operator.spec import parse_spec
from inferencemesh.planner import StagePlan

MESH = {
    "apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
    "metadata": {"name": "code", "namespace": "ml", "uid": "uid-123", "labels": {"team": "search"}},
}


def make_plan(ranges: list[tuple[int, int]], embedded: bool = False) -> Plan:
    stages = tuple(StagePlan(i, a, b, 100 * (b - a), 10, 110 * (b - a), None) for i, (a, b) in enumerate(ranges))
    return Plan(stages, "local", SpeculativeChoice("ngram", "AutoNgram", "x"), embedded)


@functools.cache
def certificates_for(subjects: tuple[tuple[str, tuple[str, ...]], ...]) -> MeshCertificates:
    """One set of certificates per set of components, so that rendering twice renders the same."""
    return settle(None, {}, {c: list(names) for c, names in subjects}, "inferencemesh code", datetime.timedelta(days=1))


def mesh_certificates(plan: Plan, pipelines: int = 1) -> MeshCertificates:
    components = [c for k in range(pipelines) for c in R.pipeline_components(plan, f"code-p{k}")]
    return certificates_for(tuple((c, tuple(n)) for c, n in R.certificate_subjects("ml", components).items()))


def children(spec: dict | None = None, ranges: list[tuple[int, int]] | None = None,
             opts: P.RenderOptions | None = None) -> dict[tuple[str, str], dict]:
    """The children of `spec`, with a plan embedded in the frontend when the spec says so (as make_plan does),
    and the mesh's certificates when the operator issues them (the default)."""
    parsed = parse_spec(spec or {"model": {"name": "bundled://imesh-code-target"}})
    plan = make_plan(ranges or [(0, 3), (3, 6), (6, 8)], parsed.frontend.embed_first_stage)
    certificates = mesh_certificates(plan, parsed.replicas) if parsed.issues_certificates else None
    objs = R.render_children(MESH, parsed, plan, opts or P.RenderOptions(), certificates)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


MESH_WIDE = [("ConfigMap", "code-plan"), ("Service", "code-frontend"), ("Service", "code-pipelines"),
             ("Deployment", "code-router"), ("ServiceAccount", "code-router"), ("Role", "code-router"),
             ("RoleBinding", "code-router"), ("PodDisruptionBudget", "code-router"),
             ("PodDisruptionBudget", "code-pipelines")]


def certificate_secrets(stages: range) -> list[tuple[str, str]]:
    """The operator's Secrets for a mesh whose stage pods are `stages`: the CA and one per component."""
    return [("Secret", "code-ca"), ("Secret", "code-p0-frontend-tls")] + [("Secret", f"code-p0-stage-{i}-tls")
                                                                       for i in stages]
