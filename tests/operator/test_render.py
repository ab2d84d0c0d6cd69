"""The pure rendering of child objects: no cluster, just the dicts the operator would write."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import re

import pytest
from render_fixtures import (
    MESH,
    MESH_WIDE,
    arg,
    certificate_secrets,
    children,
    container,
    make_plan,
    mesh_certificates,
)

from inferencemesh.config import API_KEY_ENV, STAGE_GRPC_PORT, STAGE_METRICS_PORT
from inferencemesh.operator import names as N
from inferencemesh.operator import render as R
from inferencemesh.operator import render_pod as P
from inferencemesh.operator.issuing import settle
from inferencemesh.operator.spec import parse_spec
from inferencemesh.programs.cli import build_parser


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
        assert parsed.tls_dir == P.TLS_MOUNT  # mutual TLS by default: the probes do not speak gRPC
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
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
    # metrics off: nothing advertises or opens /metrics, but the port answers the kubelet's probes
    off = children({"model": {"name": "org/m"}, "telemetry": {"metrics": False}})
    assert len(off[("NetworkPolicy", "code-p0-stage-1")]["spec"]["ingress"]) == 1
    stage = container(off[("Deployment", "code-p0-stage-1")])
    assert arg(stage["args"], "--metrics-port") == str(STAGE_METRICS_PORT)
    assert [p["name"] for p in stage["ports"]] == ["grpc", "metrics"]
    assert stage["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert [p["name"] for p in off[("Service", "code-p0-stage-1")]["spec"]["ports"]] == ["grpc"]
    template = off[("Deployment", "code-p0-stage-1")]["spec"]["template"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in template


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
    # the router presents the same key on its own requests to the frontends (their /kv/* routes)
    router_env = {e["name"]: e for e in container(objs[("Deployment", "code-router")])["env"]}
    assert router_env[API_KEY_ENV] == env[API_KEY_ENV]
    assert API_KEY_ENV not in {e["name"] for e in container(children()[("Deployment", "code-router")])["env"]}
    svc = objs[("Service", "code-frontend")]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["port"] == 443
    assert N.endpoint_url("code", "ml", parse_spec(spec)) == "http://code-frontend.ml.svc:443/v1"


def test_stage_probes_are_the_stages_own_http_answers_on_every_cluster_and_with_or_without_tls() -> None:
    """No exec probe (an interpreter per probe) and no gRPC probe (no client certificate): the stage
    answers /ready and /live in-process, so old clusters, mutual TLS and plaintext probe alike."""
    kinds = [children(), children({"model": {"name": "bundled://imesh-code-target"}, "security": {"mtls": False}})]
    probes = [{k: container(objs[("Deployment", "code-p0-stage-1")])[k]
               for k in ("startupProbe", "livenessProbe", "readinessProbe")} for objs in kinds]
    assert probes[0] == probes[1]
    ready, live, startup = probes[0]["readinessProbe"], probes[0]["livenessProbe"], probes[0]["startupProbe"]
    assert ready["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert live["httpGet"] == startup["httpGet"] == {"path": "/live", "port": "metrics"}
    # A loaded 2-core node answers a probe in up to ~2 s: no probe times out sooner, a blink is not a
    # failure, and liveness restarts only a stage silent for minutes.
    assert min(p["timeoutSeconds"] for p in (ready, live, startup)) >= 3
    assert ready["failureThreshold"] >= 3
    assert live["periodSeconds"] * live["failureThreshold"] >= 120


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
    assert "httpGet" in container(objs[("Deployment", "code-p0-stage-1")])["readinessProbe"]  # no certificate needed
    assert not [key for key in objs if key[0] == "Secret"]  # the user's Secret wins: the operator issues none
    plain = children({"model": {"name": "bundled://imesh-code-target"}, "security": {"mtls": False}})
    assert not [key for key in plain if key[0] == "Secret"]
    assert "--tls-dir" not in container(plain[("Deployment", "code-p0-frontend")])["args"]
    assert "httpGet" in container(plain[("Deployment", "code-p0-stage-1")])["readinessProbe"]


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


def test_every_pod_gets_the_kv_pool() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "kvCacheTokens": 4096})
    parser = build_parser()
    for name in ("frontend", "stage-0", "stage-1", "stage-2"):  # the stages allocate it, the frontend gives it out
        assert parser.parse_args(container(objs[("Deployment", f"code-p0-{name}")])["args"]).kv_cache_tokens == 4096


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
