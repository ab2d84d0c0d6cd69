"""The pure rendering of child objects: no cluster, just the dicts the operator would write."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import functools
import re

import pytest

from inferencemesh.config import API_KEY_ENV, FRONTEND_PORT, STAGE_GRPC_PORT, STAGE_METRICS_PORT, FrontendConfig
from inferencemesh.flags import from_args
from inferencemesh.operator import names as N
from inferencemesh.operator import render as R
from inferencemesh.operator import render_pod as P
from inferencemesh.operator import resources
from inferencemesh.operator.issuing import MeshCertificates, settle
from inferencemesh.operator.planning import Plan, SpeculativeChoice
from inferencemesh.operator.spec import parse_spec
from inferencemesh.planner import StagePlan
from inferencemesh.programs.cli import build_parser

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
             ("RoleBinding", "code-router")]


def certificate_secrets(stages: range) -> list[tuple[str, str]]:
    """The operator's Secrets for a mesh whose stage pods are `stages`: the CA and one per component."""
    return [("Secret", "code-ca"), ("Secret", "code-p0-frontend-tls")] + [("Secret", f"code-p0-stage-{i}-tls")
                                                                       for i in stages]


def test_the_children_of_a_three_stage_mesh() -> None:
    objs = children()
    assert sorted(objs) == sorted(
        MESH_WIDE + [("Deployment", "code-p0-frontend")]
        + [(kind, f"code-p0-stage-{i}") for i in range(3) for kind in ("Deployment", "Service", "NetworkPolicy")]
        + certificate_secrets(range(3))
    )
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
                                             "name": "code", "uid": "uid-123", "controller": True,
                                             "blockOwnerDeletion": True}]
        assert meta["labels"][N.LABEL_MESH] == "code" and meta["labels"]["team"] == "search"
        assert re.fullmatch(r"[0-9a-f]{20}", meta["annotations"][N.HASH_ANNOTATION])


def test_stage_arguments_carry_the_range_and_the_downstream_and_parse_with_the_real_cli() -> None:
    objs = children()
    parser = build_parser()
    for i, (start, end) in enumerate([(0, 3), (3, 6), (6, 8)]):
        c = container(objs[("Deployment", f"code-p0-stage-{i}")])
        args = c["args"]
        parsed = parser.parse_args(args)  # the stage program's own argparse contract
        assert parsed.command == "stage" and parsed.layers == (start, end)
        assert parsed.stage_index == i and parsed.num_stages == 3 and parsed.port == STAGE_GRPC_PORT
        assert parsed.model == "bundled://imesh-code-target"
        want_downstream = None if i == 2 else f"code-p0-stage-{i + 1}.ml.svc:{STAGE_GRPC_PORT}"
        assert parsed.downstream == want_downstream
        assert not hasattr(parsed, "max_batch_tokens")  # the frontend's microbatch budget, not a stage's
        assert parsed.tls_dir == P.TLS_MOUNT  # mutual TLS by default: the kubelet's gRPC probe cannot present a cert
        assert c["readinessProbe"]["exec"]["command"][-2:] == ["--server-name", f"code-p0-stage-{i}.ml.svc"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert objs[("Deployment", f"code-p0-stage-{i}")]["spec"]["strategy"] == {"type": "Recreate"}


def test_frontend_arguments_list_every_stage_in_order_and_parse() -> None:
    spec = {"model": {"name": "org/m", "revision": "v2"}, "contextLength": 4096, "maxSessions": 4,
            "wireDtype": "bfloat16", "telemetry": {"debugTracing": True},
            "speculative": {"strategy": "draft", "draft": "org/d", "window": {"policy": "fixed", "size": 6}}}
    c = container(children(spec)[("Deployment", "code-p0-frontend")])
    parsed = build_parser().parse_args(c["args"])
    assert parsed.command == "frontend" and parsed.model == "org/m" and parsed.revision == "v2"
    assert parsed.stage_addresses == tuple(f"code-p0-stage-{i}.ml.svc:50051" for i in range(3))
    assert (parsed.speculative, parsed.draft, parsed.window) == ("draft", "org/d", "6")
    assert (parsed.max_context, parsed.max_sessions, parsed.wire_dtype) == (4096, 4, "bfloat16")
    assert parsed.debug_telemetry and parsed.served_model_name == "org/m"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_bundled_model_name_is_served_without_the_scheme_and_no_draft_flag() -> None:
    c = container(children({"model": {"name": "bundled://imesh-code-target"},
                            "speculative": {"noDraft": True}})[("Deployment", "code-p0-frontend")])
    parsed = build_parser().parse_args(c["args"])
    # No window in the spec: none on the command line, so the package's declared window applies.
    assert parsed.served_model_name == "imesh-code-target" and parsed.no_draft and parsed.window is None
    windowed = children({"model": {"name": "bundled://imesh-code-target"},
                         "speculative": {"window": {"policy": "adaptive", "initial": 2}}})
    parsed = build_parser().parse_args(container(windowed[("Deployment", "code-p0-frontend")])["args"])
    assert parsed.window == "adaptive:2:1:8"


def test_stage_pods_label_their_metrics_with_the_name_clients_use() -> None:
    objs = children({"model": {"name": "org/m", "servedModelName": "coder"}})
    for name in ("code-p0-frontend", "code-p0-stage-0", "code-p0-stage-1"):
        assert build_parser().parse_args(container(objs[("Deployment", name)])["args"]).served_model_name == "coder"


@pytest.mark.parametrize("strategy", [None, "auto", "ngram", "none"])
def test_the_frontend_gets_speculative_only_when_the_spec_sets_it(strategy: str | None) -> None:
    """Unset (the CRD has no default) leaves the choice to the model package's declaration, else auto."""
    speculative = {"strategy": strategy} if strategy else {}
    args = container(children({"model": {"name": "org/m"}, "speculative": speculative})[
        ("Deployment", "code-p0-frontend")])["args"]
    assert arg(args, "--speculative") == strategy
    assert build_parser().parse_args(args).speculative == strategy


def test_network_policy_admits_only_the_frontend_and_the_previous_stage() -> None:
    objs = children()
    for i in range(3):
        pol = objs[("NetworkPolicy", f"code-p0-stage-{i}")]["spec"]
        assert pol["podSelector"]["matchLabels"] == N.stage_selector("code", 0, i)
        assert pol["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = pol["ingress"]
        sources = [p["podSelector"]["matchLabels"] for p in grpc_rule["from"]]
        expected = [N.frontend_selector("code", 0)] + ([N.stage_selector("code", 0, i - 1)] if i else [])
        assert sources == expected
        assert grpc_rule["ports"] == [{"protocol": "TCP", "port": STAGE_GRPC_PORT}]
        assert "from" not in metrics_rule and metrics_rule["ports"][0]["port"] == STAGE_METRICS_PORT
    # metrics off: no open metrics port, no metrics container port, metrics flag 0
    off = children({"model": {"name": "org/m"}, "telemetry": {"metrics": False}})
    assert len(off[("NetworkPolicy", "code-p0-stage-1")]["spec"]["ingress"]) == 1
    stage = container(off[("Deployment", "code-p0-stage-1")])
    assert arg(stage["args"], "--metrics-port") == "0" and [p["name"] for p in stage["ports"]] == ["grpc"]


def test_services_select_their_own_pods() -> None:
    objs = children()
    for i in range(3):
        svc = objs[("Service", f"code-p0-stage-{i}")]
        dep = objs[("Deployment", f"code-p0-stage-{i}")]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    front = objs[("Service", "code-frontend")]
    assert front["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_pods_are_locked_down() -> None:
    for obj in children().values():
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        # only the router talks to the API server (it watches the pipelines' EndpointSlices)
        router = obj["metadata"]["name"] == "code-router"
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is router
        sc = pod["containers"][0]["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"]
        # a writable /tmp (and, for the model's pods, the caches) on a read-only root filesystem
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts >= ({"/tmp"} if router else {"/tmp", "/cache"})


def test_pvc_api_key_placement_and_image_options() -> None:
    spec = {
        "model": {"name": "Llama-70B", "pvc": {"claimName": "models", "subPath": "llama/70b"},
                  "layout": {"numLayers": 8, "layerBytes": 10}},
        "stages": {"gpus": 2, "resources": {"limits": {"memory": "64Gi"}}, "nodeSelector": {"gpu": "a100"},
                   "tolerations": [{"key": "gpu", "operator": "Exists"}]},
        "frontend": {"apiKeySecret": {"name": "keys"}, "maxBatchTokens": 2048,
                     "service": {"type": "LoadBalancer", "port": 443}},
        "images": {"stage": "reg/stage:1", "frontend": "reg/front:1", "pullPolicy": "Never",
                   "pullSecrets": ["regcred"]},
    }
    objs = children(spec)
    stage = objs[("Deployment", "code-p0-stage-0")]["spec"]["template"]["spec"]
    c = stage["containers"][0]
    assert arg(c["args"], "--model") == "/models/llama/70b"
    assert "--max-batch-tokens" not in c["args"]
    front = container(objs[("Deployment", "code-p0-frontend")])
    assert arg(front["args"], "--max-batch-tokens") == "2048"  # the frontend's step scheduler cuts microbatches
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in stage["volumes"]
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}
    assert c["image"] == "reg/stage:1" and c["imagePullPolicy"] == "Never"
    assert stage["nodeSelector"] == {"gpu": "a100"} and stage["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert stage["imagePullSecrets"] == [{"name": "regcred"}]
    front = objs[("Deployment", "code-p0-frontend")]
    assert front["spec"]["replicas"] == 1  # one frontend per pipeline
    env = {e["name"]: e for e in container(front)["env"]}
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    svc = objs[("Service", "code-frontend")]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["port"] == 443
    assert N.endpoint_url("code", "ml", parse_spec(spec)) == "http://code-frontend.ml.svc:443/v1"


def test_old_clusters_get_an_exec_health_probe() -> None:
    c = container(children(opts=P.RenderOptions(grpc_probes=False))[("Deployment", "code-p0-stage-0")])
    assert c["readinessProbe"]["exec"]["command"][:3] == ["python", "-m", "inferencemesh.stage.healthprobe"]


def test_mutual_tls_mounts_the_secret_everywhere_and_probes_with_a_certificate() -> None:
    spec = {"model": {"name": "bundled://imesh-code-target"}, "security": {"mtlsSecretName": "mesh-tls"}}
    objs = children(spec)
    parser = build_parser()
    for name in ("code-p0-stage-0", "code-p0-stage-2", "code-p0-frontend"):
        deployment = objs[("Deployment", name)]
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "mesh-tls"
        c = container(deployment)
        assert {"name": "tls", "mountPath": P.TLS_MOUNT, "readOnly": True} in c["volumeMounts"]
        assert parser.parse_args(c["args"]).tls_dir == P.TLS_MOUNT
    probe = container(objs[("Deployment", "code-p0-stage-1")])["readinessProbe"]["exec"]["command"]
    assert probe[3:] == ["127.0.0.1:50051", "--tls-dir", P.TLS_MOUNT, "--server-name", "code-p0-stage-1.ml.svc"]
    assert not [key for key in objs if key[0] == "Secret"]  # the user's Secret wins: the operator issues none
    plain = children({"model": {"name": "bundled://imesh-code-target"}, "security": {"mtls": False}})
    assert not [key for key in plain if key[0] == "Secret"]
    assert "--tls-dir" not in container(plain[("Deployment", "code-p0-frontend")])["args"]
    assert "grpc" in container(plain[("Deployment", "code-p0-stage-1")])["readinessProbe"]


def test_operator_issued_certificates_one_secret_per_pod_mounted_and_hashed() -> None:
    plan = make_plan([(0, 3), (3, 6), (6, 8)])
    certificates = mesh_certificates(plan)
    objs = children()
    parser = build_parser()
    for component in ("code-p0-stage-0", "code-p0-stage-1", "code-p0-stage-2", "code-p0-frontend"):
        secret = objs[("Secret", f"{component}-tls")]
        assert secret["type"] == "kubernetes.io/tls"
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        leaf = certificates.leaves[component]
        assert data == {"tls.crt": leaf.cert, "tls.key": leaf.key, "ca.crt": certificates.ca.trust_bundle()}
        pod = objs[("Deployment", component)]["spec"]["template"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"{component}-tls"  # its own key, no other pod's
        assert parser.parse_args(container(objs[("Deployment", component)])["args"]).tls_dir == P.TLS_MOUNT
        assert re.fullmatch(r"[0-9a-f]{20}", pod["metadata"]["annotations"][N.TLS_HASH_ANNOTATION])
    ca = objs[("Secret", "code-ca")]
    assert ca["type"] == "Opaque" and base64.b64decode(ca["data"]["ca.key"]) == certificates.ca.signing.key
    mounted = {v["secret"]["secretName"] for (kind, _), o in objs.items() if kind == "Deployment"
               for v in o["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert "code-ca" not in mounted  # the CA's key stays with the operator

    # a renewed certificate changes its pod template (a rollout), and only that pod's
    subjects = R.certificate_subjects("ml", R.pipeline_components(plan, "code-p0"))
    renewed = settle(certificates.ca.to_data(), {}, subjects, "inferencemesh code", datetime.timedelta(days=1))
    parsed = parse_spec({"model": {"name": "bundled://imesh-code-target"}})
    again = {(o["kind"], o["metadata"]["name"]): o for o in R.render_children(
        MESH, parsed, plan, P.RenderOptions(), dataclasses.replace(
            certificates, leaves={**certificates.leaves, "code-p0-stage-1": renewed.leaves["code-p0-stage-1"]}))}
    tls_hash = lambda objs, name: objs[("Deployment", name)]["spec"]["template"]["metadata"][  # noqa: E731
        "annotations"][N.TLS_HASH_ANNOTATION]
    assert tls_hash(again, "code-p0-stage-1") != tls_hash(objs, "code-p0-stage-1")
    assert tls_hash(again, "code-p0-stage-0") == tls_hash(objs, "code-p0-stage-0")


@pytest.mark.parametrize("embedded", [False, True])
def test_each_stage_admits_the_certificates_of_the_frontend_and_the_stage_before(embedded: bool) -> None:
    """The names in --peers are those the operator's certificates carry (their common name is the
    component), so a stage takes calls from exactly its frontend and upstream stage; a Secret
    of the user's names nobody the operator knows: no --peers."""
    spec = {"model": {"name": "bundled://imesh-code-target"}, "frontend": {"embedFirstStage": embedded}}
    objs = children(spec)
    first = int(embedded)
    for index in range(first, 3):
        peers = arg(container(objs[("Deployment", f"code-p0-stage-{index}")])["args"], "--peers")
        want = ["code-p0-frontend"] + ([f"code-p0-stage-{index - 1}"] if index > first else [])
        assert peers.split(",") == want
        assert all(name in mesh_certificates(make_plan([(0, 3), (3, 6), (6, 8)], embedded)).leaves for name in want)
    byo = children({"model": {"name": "bundled://imesh-code-target"}, "security": {"mtlsSecretName": "mine"}})
    assert not arg(container(byo[("Deployment", "code-p0-stage-1")])["args"], "--peers")  # any CA-signed peer


def test_certificates_are_given_exactly_when_the_operator_issues_them() -> None:
    plan = make_plan([(0, 4), (4, 8)])
    byo = parse_spec({"model": {"name": "m"}, "security": {"mtlsSecretName": "mine"}})
    with pytest.raises(ValueError):
        R.render_children(MESH, byo, plan, P.RenderOptions(), mesh_certificates(plan))
    with pytest.raises(ValueError):
        R.render_children(MESH, parse_spec({"model": {"name": "m"}}), plan, P.RenderOptions())
    subjects = R.certificate_subjects("ml", R.pipeline_components(plan, "code-p0"))
    assert subjects["code-p0-stage-1"] == ["code-p0-stage-1", "code-p0-stage-1.ml", "code-p0-stage-1.ml.svc",
                                        "code-p0-stage-1.ml.svc.cluster.local"]
    assert sorted(subjects) == ["code-p0-frontend", "code-p0-stage-0", "code-p0-stage-1"]


@pytest.mark.parametrize(("frontend", "want"), [
    ({}, "256"),  # the frontend's default
    ({"maxBatchTokens": 1024}, "1024"),
])
def test_max_batch_tokens_is_the_frontends(frontend: dict, want: str) -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "frontend": frontend})
    assert arg(container(objs[("Deployment", "code-p0-frontend")])["args"], "--max-batch-tokens") == want
    for i in range(3):
        assert "--max-batch-tokens" not in container(objs[("Deployment", f"code-p0-stage-{i}")])["args"]


def test_both_ends_of_every_stage_stream_get_the_plans_message_limit() -> None:
    parsed = parse_spec({"model": {"name": "bundled://imesh-code-target"}})
    plan = dataclasses.replace(make_plan([(0, 3), (3, 6), (6, 8)]), message_limit=12_345_678)
    objs = {(o["kind"], o["metadata"]["name"]): o
            for o in R.render_children(MESH, parsed, plan, P.RenderOptions(), mesh_certificates(plan))}
    parser = build_parser()
    pods = [("Deployment", "code-p0-frontend")] + [("Deployment", f"code-p0-stage-{i}") for i in range(3)]
    assert {parser.parse_args(container(objs[key])["args"]).max_message_bytes for key in pods} == {12_345_678}
    for key in pods:  # no limit known (a model by its layout): the flag is absent, the programs' fallback
        assert "--max-message-bytes" not in container(children()[key])["args"]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_prefix_cache_is_the_frontends_switch(enabled: bool) -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "prefixCache": enabled})
    args = container(objs[("Deployment", "code-p0-frontend")])["args"]
    assert build_parser().parse_args(args).prefix_cache is enabled
    assert ("--no-prefix-cache" in args) is not enabled


def test_every_pod_gets_the_prefix_caches_own_room() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "prefixCacheTokens": 4096})
    parser = build_parser()
    for name in ("frontend", "stage-0", "stage-1", "stage-2"):  # the stages keep entries, the frontend indexes them
        assert parser.parse_args(container(objs[("Deployment", f"code-p0-{name}")])["args"]).prefix_cache_tokens == 4096


def test_rendering_is_deterministic_and_hashes_move_only_with_content() -> None:
    a, b = children(), children()
    assert a == b
    c = children(ranges=[(0, 2), (2, 6), (6, 8)])
    h = lambda objs, key: objs[key]["metadata"]["annotations"][N.HASH_ANNOTATION]  # noqa: E731
    assert h(a, ("Deployment", "code-p0-stage-0")) != h(c, ("Deployment", "code-p0-stage-0"))
    assert h(a, ("ConfigMap", "code-plan")) != h(c, ("ConfigMap", "code-plan"))
    # a new plan is a new revision (every pipeline object carries it: the pipeline is replaced) ...
    rev = lambda objs: objs[("Deployment", "code-p0-stage-2")]["metadata"]["labels"][N.LABEL_REVISION]  # noqa: E731
    assert rev(a) != rev(c)
    # ... and the mesh-wide objects outside the pipelines stay as they are
    for key in (("Service", "code-frontend"), ("Service", "code-pipelines"), ("Deployment", "code-router"),
                ("Role", "code-router")):
        assert h(a, key) == h(c, key)
    # within one revision, an object's hash moves only with its own content
    parsed = parse_spec({"model": {"name": "bundled://imesh-code-target"}})
    plan_a, plan_c = make_plan([(0, 3), (3, 6), (6, 8)]), make_plan([(0, 2), (2, 6), (6, 8)])
    pinned = {}
    for key, plan in (("a", plan_a), ("c", plan_c)):
        pinned[key] = {(o["kind"], o["metadata"]["name"]): o for o in R.render_children(
            MESH, parsed, plan, P.RenderOptions(), mesh_certificates(plan), revision="r1")}
    assert h(pinned["a"], ("Deployment", "code-p0-stage-0")) != h(pinned["c"], ("Deployment", "code-p0-stage-0"))
    assert h(pinned["a"], ("Deployment", "code-p0-stage-2")) == h(pinned["c"], ("Deployment", "code-p0-stage-2"))
    assert h(pinned["a"], ("Service", "code-p0-stage-0")) == h(pinned["c"], ("Service", "code-p0-stage-0"))


@pytest.mark.parametrize("name", ["code", "a" * 40, "a" * 41, "x.y.z", "9lives", "-", "UPPER", "a" * 253, "..."])
def test_base_names_are_dns_1035_and_stable(name: str) -> None:
    base = N.base_name(name)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", base) and len(base) <= 40
    prefix = N.pipeline_prefix(base, 63)
    assert len(N.stage_name(prefix, 63)) <= 63 and len(N.frontend_name(prefix)) <= 63
    assert len(N.tls_secret_name(N.stage_name(prefix, 63))) <= 253
    assert len(N.pipelines_service_name(base)) <= 63 and len(N.router_name(base)) <= 63
    assert N.base_name(name) == base
    if len(name) <= 40 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        assert base == name


def test_base_names_do_not_collide_when_folding() -> None:
    names = ["a.b", "a-b", "a_b", "A-B", "a" * 50, "a" * 51]
    assert len({N.base_name(n) for n in names}) == len(names)


def test_plan_configmap_holds_the_ranges() -> None:
    import json

    cm = children()[("ConfigMap", "code-plan")]
    doc = json.loads(cm["data"]["plan.json"])
    assert [(s["layer_start"], s["layer_end"]) for s in doc["stages"]] == [(0, 3), (3, 6), (6, 8)]
    assert doc["model"] == "bundled://imesh-code-target" and "[  3,   6)" in cm["data"]["plan.txt"]


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": "500m"}}, 1),          # the example: no limit, so the request, rounded up
    ({"requests": {"cpu": "2500m"}}, 3),
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "4"}}, 0),  # a limit: the stage reads its cgroup quota
    ({}, 0),
])
def test_stage_threads_follow_the_pods_cpu(resources: dict, threads: int) -> None:
    objs = children({"model": {"name": "org/m"}, "stages": {"resources": resources}})
    parsed = build_parser().parse_args(container(objs[("Deployment", "code-p0-stage-0")])["args"])
    assert parsed.threads == threads


def test_speculation_under_load_is_the_frontends_default_unless_the_spec_sets_it() -> None:
    from inferencemesh.config import DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE

    def frontend_flag(speculative: dict) -> int:
        objs = children({"model": {"name": "org/m"}, "speculative": speculative})
        return build_parser().parse_args(container(objs[("Deployment", "code-p0-frontend")])["args"]) \
            .speculative_disable_by_batch_size

    assert frontend_flag({}) == DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE
    assert frontend_flag({"disableByBatchSize": 0}) == 0
    assert frontend_flag({"disableByBatchSize": 12}) == 12


# ---- the first stage embedded in the frontend ---------------------------------------------------

EMBEDDED = {
    "model": {"name": "Llama-70B", "pvc": {"claimName": "models", "subPath": "llama/70b"},
              "layout": {"numLayers": 8, "layerBytes": 10}},
    "stages": {"gpus": 1, "device": "cuda",
               "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
               "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
               "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                   {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
    "frontend": {"embedFirstStage": True, "maxBatchTokens": 512,
                 "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                 "nodeSelector": {"pool": "serving"}, "tolerations": [{"key": "serving", "operator": "Exists"}]},
}


def frontend_config(objs: dict) -> FrontendConfig:
    """What the frontend program makes of its pod's arguments."""
    args = container(objs[("Deployment", "code-p0-frontend")])["args"]
    assert args[0] == "frontend"
    return from_args(FrontendConfig, build_parser().parse_args(args))


def test_an_embedded_first_stage_renders_no_stage_0_objects_and_runs_in_the_frontend() -> None:
    objs = children(EMBEDDED)
    assert sorted(objs) == sorted(
        MESH_WIDE + [("Deployment", "code-p0-frontend")]
        + [(kind, f"code-p0-stage-{i}") for i in (1, 2) for kind in ("Deployment", "Service", "NetworkPolicy")]
        + certificate_secrets(range(1, 3)))
    # the frontend's config is the separate-stage one with exactly the embedded stage's fields changed
    separate = frontend_config(children({**EMBEDDED, "frontend": {**EMBEDDED["frontend"], "embedFirstStage": False}}))
    assert separate.first_stage_layers is None and separate.num_stages == 3
    assert frontend_config(objs) == dataclasses.replace(
        separate, first_stage_layers=(0, 3),
        stage_addresses=("code-p0-stage-1.ml.svc:50051", "code-p0-stage-2.ml.svc:50051"),
        threads=2, device="cuda")
    assert separate.max_batch_tokens == 512
    assert frontend_config(objs).num_stages == 3 and frontend_config(objs).model == "/models/llama/70b"
    # the stages after it keep their index, range and downstream
    parser = build_parser()
    for i, (start, end) in ((1, (3, 6)), (2, (6, 8))):
        parsed = parser.parse_args(container(objs[("Deployment", f"code-p0-stage-{i}")])["args"])
        assert (parsed.stage_index, parsed.num_stages, parsed.layers) == (i, 3, (start, end))
    assert parser.parse_args(container(objs[("Deployment", "code-p0-stage-1")])["args"]).downstream == \
        "code-p0-stage-2.ml.svc:50051"


def test_the_embedded_frontend_pod_takes_stage_0s_resources_gpu_claim_and_placement() -> None:
    front = children(EMBEDDED)[("Deployment", "code-p0-frontend")]
    pod = front["spec"]["template"]["spec"]
    c = container(front)
    # stage 0's work and the frontend's, in one container: summed, with the GPU stage 0 would have had
    assert c["resources"] == {"requests": {"cpu": "2500m", "memory": "9Gi"},
                              "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": P.MODELS_MOUNT, "readOnly": True} in c["volumeMounts"]
    assert pod["nodeSelector"] == {"gpu": "h100", "pool": "serving"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}, {"key": "serving", "operator": "Exists"}]
    assert pod["affinity"] == EMBEDDED["stages"]["affinity"]
    assert front["spec"]["replicas"] == 1  # one frontend per pipeline
    # a GPU pod never surges (no spare GPU); loading layers gets the stage's startup budget
    assert front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800
    assert front["spec"]["template"]["metadata"]["annotations"]["inferencemesh.io/layers"] == "0:3"
    # without embedding, the frontend pod is what it was
    plain = children({**EMBEDDED, "frontend": {**EMBEDDED["frontend"], "embedFirstStage": False}})
    plain_front = plain[("Deployment", "code-p0-frontend")]
    assert container(plain_front)["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert plain_front["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "serving"}
    assert "affinity" not in plain_front["spec"]["template"]["spec"]
    assert plain_front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_stage_1_admits_the_frontend_as_its_upstream_and_nothing_else() -> None:
    objs = children(EMBEDDED)

    def sources(i: int) -> list[dict]:
        grpc_rule = objs[("NetworkPolicy", f"code-p0-stage-{i}")]["spec"]["ingress"][0]
        return [p["podSelector"]["matchLabels"] for p in grpc_rule["from"]]

    assert sources(1) == [N.frontend_selector("code", 0)]  # no selector for stage-0 pods that do not exist
    assert sources(2) == [N.frontend_selector("code", 0), N.stage_selector("code", 0, 1)]


def test_a_one_stage_plan_embedded_has_no_stage_objects_at_all() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "stages": {"count": 1, "gpus": 0},
                     "frontend": {"embedFirstStage": True}}, ranges=[(0, 8)])
    assert sorted(objs) == sorted([*MESH_WIDE, ("Deployment", "code-p0-frontend"),
                                   *certificate_secrets(range(0))])
    config = frontend_config(objs)
    assert config.stage_addresses == () and config.first_stage_layers == (0, 8) and config.num_stages == 1
    front = objs[("Deployment", "code-p0-frontend")]
    assert "nvidia.com/gpu" not in (container(front)["resources"].get("limits") or {})
    assert front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}  # no GPU to hold


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": "1500m"}}, 2),
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "2500m"}}, 3),  # the pod's quota also feeds the frontend: the limit
    ({}, 0),
])
def test_the_embedded_stage_threads_follow_stage_0s_cpu(resources: dict, threads: int) -> None:
    objs = children({"model": {"name": "org/m"}, "stages": {"resources": resources},
                     "frontend": {"embedFirstStage": True, "resources": {"limits": {"cpu": "1"}}}})
    assert frontend_config(objs).threads == threads


def test_sum_resources() -> None:
    assert resources.sum_resources({"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"nvidia.com/gpu": 2}},
                           {"requests": {"cpu": "1", "memory": "1G"}, "limits": {"cpu": "250m"}}) == {
        "requests": {"cpu": "1500m", "memory": "1536870912"}, "limits": {"nvidia.com/gpu": "2", "cpu": "250m"}}
    assert resources.sum_resources({}, {}) == {}


# ---- pipelines and the router -------------------------------------------------------------------

def test_the_routers_arguments_parse_back_with_the_routers_own_config() -> None:
    from inferencemesh.config import RouterConfig

    router = children()[("Deployment", "code-router")]
    args = container(router)["args"]
    assert args[0] == "router"
    config = from_args(RouterConfig, build_parser().parse_args(args))
    assert config == RouterConfig(frontends_service="code-pipelines", namespace="ml", port=8000, frontend_port=8000)
    assert config.check() == config
    assert router["spec"]["replicas"] == 1
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
