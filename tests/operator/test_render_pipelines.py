"""Rendering the pipelines and the router: each pipeline its own objects and revision, the router's least privilege."""

from __future__ import annotations

import datetime
import re

from render_fixtures import (
    MESH,
    arg,
    certificates_for,
    children,
    container,
    make_plan,
    mesh_certificates,
)

from inferencemesh.config import FRONTEND_PORT
from inferencemesh.flags import from_args
from inferencemesh.operator import names as N
from inferencemesh.operator import render as R
from inferencemesh.operator import render_pod as P
from inferencemesh.operator.issuing import settle
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.spec import parse_spec
from inferencemesh.programs.cli import build_parser


def test_the_routers_arguments_parse_back_with_the_routers_own_config() -> None:
    from inferencemesh.config import RouterConfig

    router = children()[("Deployment", "code-router")]
    args = container(router)["args"]
    assert args[0] == "router"
    config = from_args(RouterConfig, build_parser().parse_args(args))
    assert config == RouterConfig(frontends_service="code-pipelines", namespace="ml", port=8000, frontend_port=8000)
    assert config.check() == config
    assert router["spec"]["replicas"] == 2  # never alone by default: a router pod's loss is no outage
    c = container(router)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["ports"][0]["name"] == "http"
    assert c["image"] == P.DEFAULT_FRONTEND_IMAGE  # the router runs from the frontend image
    scaled = children({"model": {"name": "org/m"}, "router": {"replicas": 3, "nodeSelector": {"pool": "edge"}}})
    assert scaled[("Deployment", "code-router")]["spec"]["replicas"] == 3
    assert scaled[("Deployment", "code-router")]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "edge"}


def test_the_router_has_least_privilege_through_its_own_service_account() -> None:
    objs = children()
    role = objs[("Role", "code-router")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "code-router")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "code-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "code-router", "namespace": "ml"}]
    account = objs[("ServiceAccount", "code-router")]
    assert account["automountServiceAccountToken"] is False  # only the router's pod mounts its token
    pod = objs[("Deployment", "code-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "code-router" and pod["automountServiceAccountToken"] is True
    for (kind, name), obj in objs.items():
        if kind == "Deployment" and name != "code-router":
            spec = obj["spec"]["template"]["spec"]
            assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec, name
    assert [key for key in objs if key[0] in ("Role", "RoleBinding", "ServiceAccount", "ClusterRole")] == \
        [("ServiceAccount", "code-router"), ("Role", "code-router"), ("RoleBinding", "code-router")]


def pod_labels(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def test_the_endpoint_selects_the_router_and_the_headless_service_every_frontend() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "replicas": 2})
    endpoint = objs[("Service", "code-frontend")]["spec"]
    pipelines = objs[("Service", "code-pipelines")]["spec"]
    assert pipelines["clusterIP"] == "None" and pipelines["ports"][0]["port"] == FRONTEND_PORT
    selects = lambda svc, obj: all(pod_labels(obj).get(k) == v for k, v in svc["selector"].items())  # noqa: E731
    deployments = {name: obj for (kind, name), obj in objs.items() if kind == "Deployment"}
    assert sorted(name for name, d in deployments.items() if selects(endpoint, d)) == ["code-router"]
    assert sorted(name for name, d in deployments.items() if selects(pipelines, d)) == \
        ["code-p0-frontend", "code-p1-frontend"]
    router = deployments["code-router"]
    assert router["spec"]["selector"]["matchLabels"] == endpoint["selector"]
    assert pipelines["selector"] == N.frontends_selector("code")


def test_each_pipeline_has_its_own_stages_frontend_and_network_policies() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "replicas": 2})
    for k in (0, 1):
        assert ("Deployment", f"code-p{k}-frontend") in objs and ("Secret", f"code-p{k}-frontend-tls") in objs
        front = build_parser().parse_args(container(objs[("Deployment", f"code-p{k}-frontend")])["args"])
        assert front.stage_addresses == tuple(f"code-p{k}-stage-{i}.ml.svc:50051" for i in range(3))
        for i in range(3):
            args = container(objs[("Deployment", f"code-p{k}-stage-{i}")])["args"]
            assert build_parser().parse_args(args).downstream == \
                (f"code-p{k}-stage-{i + 1}.ml.svc:50051" if i < 2 else None)
            want = [f"code-p{k}-frontend"] + ([f"code-p{k}-stage-{i - 1}"] if i else [])
            assert arg(args, "--peers").split(",") == want
    deployments = {name: obj for (kind, name), obj in objs.items() if kind == "Deployment"}
    for k in (0, 1):
        for i in range(3):
            policy = objs[("NetworkPolicy", f"code-p{k}-stage-{i}")]["spec"]
            sources = [p["podSelector"]["matchLabels"] for p in policy["ingress"][0]["from"]]
            admitted = sorted(name for name, d in deployments.items()
                              if any(all(pod_labels(d).get(a) == b for a, b in sel.items()) for sel in sources))
            want = [f"code-p{k}-frontend"] + ([f"code-p{k}-stage-{i - 1}"] if i else [])
            assert admitted == sorted(want), (k, i, admitted)  # never the other pipeline's pods
            protected = [name for name, d in deployments.items()
                         if all(pod_labels(d).get(a) == b for a, b in policy["podSelector"]["matchLabels"].items())]
            assert protected == [f"code-p{k}-stage-{i}"]
    # one Service per stage of each pipeline, selecting its pod only
    for k in (0, 1):
        svc = objs[("Service", f"code-p{k}-stage-1")]["spec"]["selector"]
        assert [n for n, d in deployments.items() if all(pod_labels(d).get(a) == b for a, b in svc.items())] == \
            [f"code-p{k}-stage-1"]


def test_the_frontend_drains_before_it_stops() -> None:
    objs = children({"model": {"name": "org/m"}, "frontend": {"drainTimeoutSeconds": 20, "preStopSeconds": 3}})
    front = objs[("Deployment", "code-p0-frontend")]
    c = container(front)
    assert front["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 3 + 20 + 10
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "3"]}}}
    assert build_parser().parse_args(c["args"]).drain_timeout == 20
    default = container(children()[("Deployment", "code-p0-frontend")])
    assert default["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert children()[("Deployment", "code-p0-frontend")]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 5 + 30 + 10
    no_wait = children({"model": {"name": "org/m"}, "frontend": {"preStopSeconds": 0, "drainTimeoutSeconds": 0}})
    front = no_wait[("Deployment", "code-p0-frontend")]
    assert "lifecycle" not in container(front) and front["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 10
    for (kind, _), obj in children().items():  # a crash's own reason, else its log's tail
        if kind == "Deployment":
            assert container(obj)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_every_pipeline_object_carries_its_pipeline_and_the_revision() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "replicas": 2})
    revisions = set()
    for (kind, name), obj in objs.items():
        m = re.fullmatch(r"code-p(\d+)-(stage-\d+|frontend)(-tls)?", name)
        labels = obj["metadata"]["labels"]
        if m is None or kind == "Secret":
            assert N.LABEL_PIPELINE not in labels and N.LABEL_REVISION not in labels, (kind, name)
            continue
        assert labels[N.LABEL_PIPELINE] == m.group(1), (kind, name)
        revisions.add(labels[N.LABEL_REVISION])
        if kind == "Deployment":
            assert pod_labels(obj)[N.LABEL_PIPELINE] == m.group(1)
            assert pod_labels(obj)[N.LABEL_REVISION] == labels[N.LABEL_REVISION]
            assert N.LABEL_REVISION not in obj["spec"]["selector"]["matchLabels"]  # a selector never moves
    assert len(revisions) == 1 and re.fullmatch(r"[0-9a-f]{10}", revisions.pop())


def revision_of(spec: dict, plan: Plan | None = None, opts: P.RenderOptions | None = None) -> str:
    return R.pipeline_revision(MESH, parse_spec(spec), plan or make_plan([(0, 3), (3, 6), (6, 8)]),
                               opts or P.RenderOptions())


def test_the_revision_moves_with_what_a_pipeline_runs_and_not_with_their_number() -> None:
    base = {"model": {"name": "org/m"}}
    rev = revision_of(base)
    assert revision_of(base) == rev
    assert revision_of({"model": {"name": "org/other"}}) != rev
    assert revision_of({**base, "images": {"stage": "reg/stage:2"}}) != rev
    assert revision_of({**base, "images": {"frontend": "reg/front:2"}}) != rev
    assert revision_of(base, opts=P.RenderOptions(stage_image="reg/stage:3")) != rev
    assert revision_of(base, plan=make_plan([(0, 4), (4, 8)])) != rev
    assert revision_of({**base, "replicas": 5}) == rev
    assert revision_of({**base, "router": {"replicas": 2}}) == rev  # the router is not a pipeline's
    assert revision_of({**base, "restartBudget": {"restarts": 9}}) == rev
    # a certificate renewal rolls the pods in place, as the same revision
    spec = {"model": {"name": "bundled://imesh-code-target"}, "replicas": 1}
    plan = make_plan([(0, 3), (3, 6), (6, 8)])
    certificates = mesh_certificates(plan)
    subjects = R.certificate_subjects("ml", R.pipeline_components(plan, "code-p0"))
    renewed = settle(certificates.ca.to_data(), {}, subjects, "inferencemesh code", datetime.timedelta(days=1))
    before = R.render_children(MESH, parse_spec(spec), plan, P.RenderOptions(), certificates)
    after = R.render_children(MESH, parse_spec(spec), plan, P.RenderOptions(), renewed)
    label = lambda objs: {o["metadata"]["labels"].get(N.LABEL_REVISION) for o in objs} - {None}  # noqa: E731
    assert label(before) == label(after) == {rev_of_spec(spec, plan)}
    front = lambda objs: next(o for o in objs if o["metadata"]["name"] == "code-p0-frontend")  # noqa: E731
    assert pod_labels(front(before)) == pod_labels(front(after))
    assert front(before)["spec"]["template"]["metadata"]["annotations"][N.TLS_HASH_ANNOTATION] != \
        front(after)["spec"]["template"]["metadata"]["annotations"][N.TLS_HASH_ANNOTATION]


def rev_of_spec(spec: dict, plan: Plan) -> str:
    return R.pipeline_revision(MESH, parse_spec(spec), plan, P.RenderOptions())


def test_the_pipelines_rendered_are_the_decisions_and_a_failed_ones_frontend_runs_no_pod() -> None:
    parsed = parse_spec({"model": {"name": "bundled://imesh-code-target"}, "replicas": 2})
    plan = make_plan([(0, 4), (4, 8)])
    certificates = certificates_for(tuple(
        (c, tuple(n)) for c, n in R.certificate_subjects(
            "ml", [c for k in (0, 2) for c in R.pipeline_components(plan, f"code-p{k}")]).items()))
    objs = {(o["kind"], o["metadata"]["name"]): o for o in R.render_children(
        MESH, parsed, plan, P.RenderOptions(), certificates, pipelines={0: True, 2: False}, revision="abc")}
    assert sorted(name for kind, name in objs if kind == "Deployment") == \
        ["code-p0-frontend", "code-p0-stage-0", "code-p0-stage-1", "code-p2-frontend", "code-p2-stage-0",
         "code-p2-stage-1", "code-router"]
    assert objs[("Deployment", "code-p0-frontend")]["spec"]["replicas"] == 1
    assert objs[("Deployment", "code-p2-frontend")]["spec"]["replicas"] == 0  # Failed: nothing routes to it
    assert objs[("Deployment", "code-p2-stage-1")]["spec"]["replicas"] == 1  # its pods are kept for debugging
    assert objs[("Deployment", "code-p2-stage-1")]["metadata"]["labels"][N.LABEL_REVISION] == "abc"
