"""The operator against a real kube-apiserver + kube-controller-manager (see conftest.py).

The operator runs as a subprocess with the chart's ServiceAccount token, so these tests also prove
the chart's RBAC is enough. No kubelet runs: pods stay Pending and the tests play kubelet by
writing pod status, which the real ReplicaSet/Deployment controllers turn into readiness.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from imesh_k8s import REPO, ControlPlane, Kubelet, OperatorProcess, patch_pod_status, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
NS = "mesh-tests"
EXAMPLE = REPO / "examples" / "inferencemesh.yaml"
CHILD_KINDS = "configmaps,deployments,services,networkpolicies,serviceaccounts,roles,rolebindings"


@pytest.fixture(scope="module")
def ns(cluster: ControlPlane, operator: OperatorProcess) -> str:
    cluster.kubectl("create", "namespace", NS)
    return NS


def status_of(cluster: ControlPlane, name: str, ns: str = NS) -> dict:
    return cluster.get_json("inferencemesh", name, "-n", ns).get("status") or {}


def cond(status: dict, ctype: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c["type"] == ctype), {})


def wait_condition(cluster: ControlPlane, name: str, ctype: str, value: str, reason: str | None = None,
                   timeout: float = 60, ns: str = NS) -> dict:
    def check() -> dict | bool:
        st = status_of(cluster, name, ns)
        c = cond(st, ctype)
        return st if c.get("status") == value and (reason is None or c.get("reason") == reason) else False

    return wait_for(check, timeout, f"{name}: {ctype}={value} {reason or ''}")  # type: ignore[return-value]


def children(cluster: ControlPlane, base: str, ns: str = NS, kinds: str = CHILD_KINDS) -> dict[tuple[str, str], dict]:
    items = cluster.get_json(kinds, "-n", ns, "-l", f"inferencemesh.io/mesh={base}")["items"]
    return {(o["kind"], o["metadata"]["name"]): o for o in items}


def events_for(cluster: ControlPlane, name: str, ns: str = NS) -> list[tuple[str, str]]:
    items = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["type"], e["reason"]) for e in items]


def mesh_doc(name: str, spec: dict) -> dict:
    return {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": name},
            "spec": spec}


def set_pod_status(cluster: ControlPlane, pod: dict, *, ready: bool, waiting: str | None = None,
                   restarts: int = 0) -> None:
    """What a kubelet would report for the pod's single container."""
    patch_pod_status(cluster, pod, NS, ready=ready, waiting=waiting, restarts=restarts)


def pods_of(cluster: ControlPlane, base: str) -> list[dict]:
    return cluster.get_json("pods", "-n", NS, "-l", f"inferencemesh.io/mesh={base}")["items"]


# ---- the operator process ---------------------------------------------------------------------

def test_operator_is_live_and_exports_metrics(operator: OperatorProcess) -> None:
    assert urllib.request.urlopen(operator.liveness, timeout=5).status == 200
    text = urllib.request.urlopen(operator.metrics, timeout=5).read().decode()
    assert "inferencemesh_operator_reconcile_duration_seconds_count" in text


# ---- schema validation at the API server ------------------------------------------------------

@pytest.mark.parametrize(("spec", "message"), [
    ({"stages": {"count": 0}}, "spec.stages.count"),
    ({"model": {"name": "m", "dtype": "float8"}}, 'Unsupported value: "float8"'),
    ({"speculative": {"strategy": "sometimes"}}, "spec.speculative.strategy"),
    ({"frontend": {"service": {"port": 70000}}}, "spec.frontend.service.port"),
    ({"model": {}}, "spec.model.name: Required value"),
    ({"stages": {"memory": ["lots"]}}, "spec.stages.memory"),
])
def test_the_api_server_rejects_schema_violations(cluster: ControlPlane, ns: str, spec: dict, message: str) -> None:
    body = {"model": {"name": "org/m"}, **spec}
    # --validate=false: no client-side check, the API server alone judges the object
    doc = yaml.safe_dump(mesh_doc("bad", body))
    proc = cluster.kubectl("create", "--validate=false", "-n", ns, "-f", "-", input=doc, check=False)
    assert "is invalid" in proc.stderr
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert cluster.kubectl("get", "inferencemesh", "bad", "-n", ns, check=False).returncode != 0


def test_the_api_server_prunes_the_removed_fields(cluster: ControlPlane, ns: str) -> None:
    """stages.maxBatchTokens and frontend.replicas left the v1alpha1 CRD: kubectl's validation
    refuses a spec that still sets them, naming the field; without it, the API server accepts the
    spec and stores it without them (the structural schema prunes unknown fields)."""
    body = {"model": {"name": "org/m"}, "stages": {"maxBatchTokens": 64}, "frontend": {"replicas": 3}}
    doc = yaml.safe_dump(mesh_doc("removed-fields", body))
    refused = cluster.kubectl("create", "-n", ns, "-f", "-", input=doc, check=False)
    assert refused.returncode != 0 and "unknown field" in refused.stderr, refused.stderr
    proc = cluster.kubectl("create", "--validate=false", "-n", ns, "-f", "-", input=doc, check=False)
    assert proc.returncode == 0, proc.stderr
    try:
        stored = cluster.get_json("inferencemesh", "removed-fields", "-n", ns)["spec"]
        assert "maxBatchTokens" not in stored["stages"] and "replicas" not in stored["frontend"]
    finally:
        cluster.kubectl("delete", "inferencemesh", "removed-fields", "-n", ns, "--wait=false")


# ---- the example, end to end on the control plane ---------------------------------------------

def test_the_example_creates_planned_children(cluster: ControlPlane, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    st = wait_condition(cluster, "code", "Planned", "True")
    mesh = cluster.get_json("inferencemesh", "code", "-n", ns)
    objs = children(cluster, "code")
    stage_names = [f"code-p0-stage-{i}" for i in range(2)]
    assert set(objs) == ({("ConfigMap", "code-plan"), ("Deployment", "code-p0-frontend"),
                          ("Service", "code-frontend"), ("Service", "code-pipelines"), ("Deployment", "code-router"),
                          ("ServiceAccount", "code-router"), ("Role", "code-router"), ("RoleBinding", "code-router")}
                         | {(k, n) for n in stage_names for k in ("Deployment", "Service", "NetworkPolicy")})
    for (kind, name), obj in objs.items():
        ref, *held_by = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == mesh["metadata"]["uid"] and ref["kind"] == "InferenceMesh" and ref["controller"]
        # stages and the router are also owned by frontend pods (teardown.py), which no kubelet runs here
        assert all(r["kind"] == "Pod" and not r["controller"] for r in held_by), (kind, name)
    plan = json.loads(objs[("ConfigMap", "code-plan")]["data"]["plan.json"])
    ranges = [(s["layer_start"], s["layer_end"]) for s in plan["stages"]]
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0]
    for i, (start, end) in enumerate(ranges):
        args = objs[("Deployment", f"code-p0-stage-{i}")]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--layers") + 1] == f"{start}:{end}"
        assert st["stages"][i]["layers"] == f"{start}:{end}" and st["stages"][i]["ready"] is False
    args0 = objs[("Deployment", "code-p0-stage-0")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args0[args0.index("--downstream") + 1] == f"code-p0-stage-1.{ns}.svc:50051"
    front = objs[("Deployment", "code-p0-frontend")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert front[front.index("--stage-addresses") + 1] == \
        f"code-p0-stage-0.{ns}.svc:50051,code-p0-stage-1.{ns}.svc:50051"
    policy = objs[("NetworkPolicy", "code-p0-stage-1")]["spec"]
    sources = [p["podSelector"]["matchLabels"] for p in policy["ingress"][0]["from"]]
    assert {"inferencemesh.io/mesh": "code", "app.kubernetes.io/component": "frontend",
            "inferencemesh.io/pipeline": "0"} in sources
    assert {"inferencemesh.io/mesh": "code", "app.kubernetes.io/component": "stage", "inferencemesh.io/pipeline": "0",
            "inferencemesh.io/stage": "0"} in sources
    # the router may read EndpointSlices and nothing else, and the API server took its Role from the operator
    assert objs[("Role", "code-router")]["rules"] == [{"apiGroups": ["discovery.k8s.io"],
                                                       "resources": ["endpointslices"],
                                                       "verbs": ["get", "list", "watch"]}]
    assert objs[("Service", "code-frontend")]["spec"]["selector"] == \
        {"inferencemesh.io/mesh": "code", "app.kubernetes.io/component": "router"}
    assert [p["state"] for p in st["pipelines"]] == ["Progressing"] and st["pipelinesSummary"] == "0/1"
    assert st["phase"] == "Progressing" and st["observedGeneration"] == mesh["metadata"]["generation"]
    assert cond(st, "StagesReady")["status"] == "False" and cond(st, "Ready")["status"] == "False"
    assert cond(st, "Degraded")["status"] == "False"
    assert st["endpoint"] == f"http://code-frontend.{ns}.svc:8000/v1"
    # An explicit strategy is what runs; unset, the bundled package's declared draft (the CRD has no default).
    explicit = yaml.safe_load(EXAMPLE.read_text())["spec"].get("speculative", {}).get("strategy")
    expected = (explicit, "Requested") if explicit else ("draft", "PackageDefault")
    assert (st["speculative"]["strategy"], st["speculative"]["reason"]) == expected
    wait_for(lambda: ("Normal", "Planned") in events_for(cluster, "code"), 30, "a Planned event")


def test_kubectl_get_shows_the_printer_columns(cluster: ControlPlane, ns: str) -> None:
    out = cluster.kubectl("get", "imesh", "code", "-n", ns).stdout.splitlines()
    assert out[0].split() == ["NAME", "MODEL", "PIPELINES", "STAGES", "READY", "ENDPOINT", "AGE"]
    row = out[1].split()
    assert row[:6] == ["code", "bundled://imesh-code-target", "0/1", "0/2", "False",
                       f"http://code-frontend.{ns}.svc:8000/v1"]
    wide = cluster.kubectl("get", "imesh", "code", "-n", ns, "-o", "wide").stdout.splitlines()
    assert "PHASE" in wide[0].split() and "Progressing" in wide[1].split()


def test_pod_readiness_makes_the_mesh_ready_and_a_crash_loop_degrades_it(cluster: ControlPlane, ns: str) -> None:
    # two stages, the frontend and the router's 2 pods (its default)
    pods = wait_for(lambda: len(pods_of(cluster, "code")) == 5 and pods_of(cluster, "code"), 60, "5 pods")
    for pod in pods:  # type: ignore[union-attr]
        set_pod_status(cluster, pod, ready=True)
    st = wait_condition(cluster, "code", "Ready", "True", timeout=90)
    assert st["phase"] == "Ready" and st["stagesSummary"] == "2/2" and all(s["ready"] for s in st["stages"])
    assert cond(st, "StagesReady")["status"] == "True" and cond(st, "FrontendReady")["status"] == "True"
    assert st["replicas"] == 1 and st["pipelinesSummary"] == "1/1" and st["pipelines"][0]["state"] == "Ready"
    wait_for(lambda: ("Normal", "Ready") in events_for(cluster, "code"), 30, "a Ready event")

    stage1 = next(p for p in pods_of(cluster, "code") if p["metadata"]["labels"].get("inferencemesh.io/stage") == "1")
    set_pod_status(cluster, stage1, ready=False, waiting="CrashLoopBackOff", restarts=3)
    st = wait_condition(cluster, "code", "Degraded", "True", "PodsFailing", timeout=90)
    assert st["phase"] == "Degraded" and "CrashLoopBackOff (restarts 3)" in cond(st, "Degraded")["message"]
    assert stage1["metadata"]["name"] in cond(st, "Degraded")["message"]
    wait_for(lambda: ("Warning", "Degraded") in events_for(cluster, "code"), 30, "a Degraded event")

    set_pod_status(cluster, stage1, ready=True, restarts=3)
    st = wait_condition(cluster, "code", "Degraded", "False", timeout=90)
    st = wait_condition(cluster, "code", "Ready", "True", timeout=90)
    assert st["phase"] == "Ready"
    wait_for(lambda: ("Normal", "Recovered") in events_for(cluster, "code"), 30, "a Recovered event")


def _versions(cluster: ControlPlane, ns: str, base: str) -> dict[tuple[str, str], str]:
    return {key: o["metadata"]["resourceVersion"] for key, o in children(cluster, base, ns).items()}


def test_a_second_reconcile_writes_nothing(cluster: ControlPlane, ns: str, operator: OperatorProcess,
                                           bundled_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes import config

    from inferencemesh.operator.kube import Kube
    from inferencemesh.operator.reconcile import Reconciler
    from inferencemesh.operator.render_pod import RenderOptions

    wait_condition(cluster, "code", "Ready", "True")
    time.sleep(2)  # let the last events settle
    before = _versions(cluster, ns, "code")
    mesh_rv = cluster.get_json("inferencemesh", "code", "-n", ns)["metadata"]["resourceVersion"]
    writes = operator.metric("inferencemesh_operator_writes_total")

    # 1. the same reconcile, in this process, with the operator's options: no write at all
    monkeypatch.setenv("INFERENCEMESH_BUNDLED_DIR", str(bundled_dir))
    api = config.new_client_from_config(config_file=str(operator.kubeconfig))
    reconciler = Reconciler(Kube(api), options=RenderOptions())
    for _ in range(2):
        assert reconciler.reconcile(ns, "code").writes == []

    # 2. the operator reconciles on an unrelated change (an annotation) and writes nothing either
    unchanged = operator.metric("inferencemesh_operator_reconciles_total", 'result="unchanged"')
    cluster.kubectl("annotate", "inferencemesh", "code", "-n", ns, "test/poke=1")
    wait_for(lambda: operator.metric("inferencemesh_operator_reconciles_total", 'result="unchanged"') > unchanged,
             30, "the operator to reconcile after the annotation")
    time.sleep(1)
    assert _versions(cluster, ns, "code") == before
    mesh = cluster.get_json("inferencemesh", "code", "-n", ns)
    assert int(mesh["metadata"]["resourceVersion"]) > int(mesh_rv)  # only the annotation moved it
    assert "kopf.zalando.org/last-handled-configuration" not in mesh["metadata"].get("annotations", {})
    assert not mesh["metadata"].get("finalizers")  # deletion never waits for the operator
    assert operator.metric("inferencemesh_operator_writes_total") == writes


def test_a_restarted_operator_resumes_without_writing(cluster: ControlPlane, ns: str, operator: OperatorProcess,
                                                      bundled_dir: Path) -> None:
    """A fresh operator process (as after a restart) lists every mesh, reconciles it and writes nothing."""
    from imesh_k8s import start_operator, stop_operator

    before = _versions(cluster, ns, "code")
    second = start_operator(cluster, operator.kubeconfig, cluster.workdir,
                            {"INFERENCEMESH_BUNDLED_DIR": str(bundled_dir)})
    try:
        wait_for(lambda: second.metric("inferencemesh_operator_reconciles_total") >= 1, 30,
                 "the restarted operator to reconcile the existing mesh")
        time.sleep(1)
        assert second.metric("inferencemesh_operator_writes_total") == 0, second.log()
        assert second.metric("inferencemesh_operator_reconciles_total", 'result="changed"') == 0
    finally:
        stop_operator(second)
    assert _versions(cluster, ns, "code") == before


def pipeline_states(status: dict) -> dict[int, str]:
    return {p["index"]: p["state"] for p in status.get("pipelines") or []}


def test_an_update_replans_and_replaces_the_pipeline(cluster: ControlPlane, ns: str) -> None:
    """A new plan is a new revision: a new pipeline starts beside the old one, which serves until
    the new one is ready and then drains."""
    old = status_of(cluster, "code")
    old_stage0 = children(cluster, "code")[("Deployment", "code-p0-stage-0")]
    with Kubelet(cluster, ns, "inferencemesh.io/mesh=code") as kubelet:
        kubelet.hold.add("code-p1-")  # the new pipeline's pods stay unready until released
        cluster.kubectl("patch", "inferencemesh", "code", "-n", ns, "--type=merge",
                        "-p", '{"spec":{"stages":{"count":3}}}')
        st = wait_for(lambda: (s := status_of(cluster, "code")).get("stagesSummary", "").endswith("/3") and s, 60,
                      "a 3-stage plan")
        assert st["planHash"] != old["planHash"] and len(st["stages"]) == 3
        objs = wait_for(lambda: (o := children(cluster, "code")) and ("Deployment", "code-p1-frontend") in o and o,
                        60, "the new pipeline's frontend")
        plan = json.loads(objs[("ConfigMap", "code-plan")]["data"]["plan.json"])
        ranges = [(s["layer_start"], s["layer_end"]) for s in plan["stages"]]
        assert [s["layers"] for s in st["stages"]] == [f"{a}:{b}" for a, b in ranges]
        for kind in ("Deployment", "Service", "NetworkPolicy"):
            assert (kind, "code-p1-stage-2") in objs
        stage0 = objs[("Deployment", "code-p1-stage-0")]
        args = stage0["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--layers") + 1] == f"{ranges[0][0]}:{ranges[0][1]}"
        assert args[args.index("--num-stages") + 1] == "3"
        front = objs[("Deployment", "code-p1-frontend")]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert len(front[front.index("--stage-addresses") + 1].split(",")) == 3
        # the old pipeline serves, untouched, until the new one is ready
        assert objs[("Deployment", "code-p0-stage-0")]["metadata"]["generation"] == \
            old_stage0["metadata"]["generation"]
        assert ("Deployment", "code-p0-frontend") in objs
        wait_for(lambda: pipeline_states(status_of(cluster, "code")) == {0: "Outdated", 1: "Progressing"}, 30,
                 "pipeline 0 Outdated and pipeline 1 Progressing")
        wait_for(lambda: ("Normal", "Replanned") in events_for(cluster, "code"), 30, "a Replanned event")
        assert ("Deployment", "code-p0-frontend") in children(cluster, "code")

        kubelet.hold.clear()  # the new pipeline gets ready: the old one drains and goes
        wait_for(lambda: not any(n.startswith("code-p0-") for _, n in children(cluster, "code")), 90,
                 "the old pipeline's objects to go")
        st = wait_condition(cluster, "code", "Ready", "True", timeout=60)
        assert pipeline_states(st) == {1: "Ready"} and st["stagesSummary"] == "3/3"

        cluster.kubectl("patch", "inferencemesh", "code", "-n", ns, "--type=merge",
                        "-p", '{"spec":{"stages":{"count":2}}}')
        wait_for(lambda: not any(n.endswith("-stage-2") for _, n in children(cluster, "code")), 90,
                 "stage 2's objects to go")
        st = wait_condition(cluster, "code", "Ready", "True", timeout=60)
        assert st["stagesSummary"] == "2/2" and pipeline_states(st) == {0: "Ready"}  # the lowest free index


def test_scale_subresource_scales_the_pipelines(cluster: ControlPlane, ns: str) -> None:
    with Kubelet(cluster, ns, "inferencemesh.io/mesh=code"):
        cluster.kubectl("scale", "inferencemesh", "code", "-n", ns, "--replicas=2")
        # 120 s, as the other waits for a new pipeline's objects: once in CI (2 busy cores) 60 s passed without them
        objs = wait_for(lambda: (o := children(cluster, "code")) and ("Deployment", "code-p1-frontend") in o and o, 120,
                        "pipeline 1's frontend")
        assert {("Deployment", "code-p1-stage-0"), ("Deployment", "code-p1-stage-1")} <= set(objs)  # type: ignore[arg-type]
        wait_for(lambda: status_of(cluster, "code").get("replicas") == 2, 60, "status.replicas == 2")
        cluster.kubectl("scale", "inferencemesh", "code", "-n", ns, "--replicas=1")
        wait_for(lambda: not any(n.startswith("code-p1-") for _, n in children(cluster, "code")), 60,
                 "pipeline 1 to go")
        wait_for(lambda: status_of(cluster, "code").get("pipelinesSummary") == "1/1", 60, "1/1 pipelines")


@pytest.mark.parametrize(("name", "stages", "reason", "message"), [
    ("too-many-stages", {"count": 9}, "PlanFailed", "9 stages requested but the model has only 4 layers"),
    ("does-not-fit", {"count": 2, "memory": ["100Mi"]}, "PlanFailed", "does not fit"),
    ("overlapping", {"count": 2, "ranges": [{"start": 0, "end": 3}, {"start": 2, "end": 4}]},
     "InvalidSpec", "stages.ranges must not overlap"),
    ("gap", {"count": 2, "ranges": [{"start": 0, "end": 1}, {"start": 2, "end": 4}]},
     "PlanFailed", "layers [1, 2) are not assigned"),
])
def test_impossible_specs_end_planned_false(cluster: ControlPlane, ns: str, tiny_model: Path, name: str,
                                            stages: dict, reason: str, message: str) -> None:
    cluster.apply(mesh_doc(name, {"model": {"name": str(tiny_model)}, "stages": stages}), ns)
    st = wait_condition(cluster, name, "Planned", "False", reason)
    assert message in cond(st, "Planned")["message"]
    assert st["phase"] == "Failed" and cond(st, "Ready")["reason"] == reason
    assert children(cluster, name) == {}
    wait_for(lambda: ("Warning", reason) in events_for(cluster, name), 30, f"a {reason} event")
    # fixing the spec recovers
    cluster.kubectl("patch", "inferencemesh", name, "-n", ns, "--type=json",
                    "-p", '[{"op": "replace", "path": "/spec/stages", "value": {"count": 2}}]')
    wait_condition(cluster, name, "Planned", "True")
    assert ("Deployment", f"{name}-p0-stage-1") in children(cluster, name)
    cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")


def test_a_family_that_cannot_be_split_ends_planned_false_in_one_line(cluster: ControlPlane, ns: str,
                                                                      tmp_path: Path) -> None:
    """The operator (run without torch and transformers, as in its image) reads the same family
    decision as `plan` and `serve` (modeling/families.py's recorded table) and names the reason."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 64}))
    cluster.apply(mesh_doc("gpt2", {"model": {"name": str(model)}}), ns)
    st = wait_condition(cluster, "gpt2", "Planned", "False", "ModelUnreadable")
    message = cond(st, "Planned")["message"]
    assert "model_type 'gpt2' cannot be served: not the standard layout: its decoder is model.transformer" in message
    assert "\n" not in message
    assert children(cluster, "gpt2") == {}
    cluster.kubectl("delete", "inferencemesh", "gpt2", "-n", ns, "--wait=false")


def test_an_embedded_first_stage_has_no_stage_0_objects_and_switching_it_prunes_or_restores_them(
        cluster: ControlPlane, ns: str, tiny_model: Path) -> None:
    name = "embed"
    cluster.apply(mesh_doc(name, {"model": {"name": str(tiny_model)}, "stages": {"count": 2},
                                  "frontend": {"embedFirstStage": True}}), ns)
    wait_condition(cluster, name, "Planned", "True")
    objs = wait_for(lambda: (o := children(cluster, name)) and ("Deployment", f"{name}-p0-frontend") in o and o, 60,
                    "the embedded mesh's children")
    assert not any(key[1].endswith("-stage-0") for key in objs)  # type: ignore[union-attr]
    assert {("Deployment", f"{name}-p0-stage-1"), ("Service", f"{name}-p0-stage-1"),
            ("NetworkPolicy", f"{name}-p0-stage-1")} <= set(objs)  # type: ignore[arg-type]
    front = objs[("Deployment", f"{name}-p0-frontend")]["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    args = front["args"]
    assert args[args.index("--first-stage-layers") + 1] == "0:2"
    assert args[args.index("--stage-addresses") + 1] == f"{name}-p0-stage-1.{ns}.svc:50051"
    assert front["resources"]["limits"]["nvidia.com/gpu"] == "1"
    policy = objs[("NetworkPolicy", f"{name}-p0-stage-1")]["spec"]  # type: ignore[index]
    assert [p["podSelector"]["matchLabels"] for p in policy["ingress"][0]["from"]] == [
        {"inferencemesh.io/mesh": name, "app.kubernetes.io/component": "frontend", "inferencemesh.io/pipeline": "0"}]

    # readiness comes from the frontend: no stage-0 Deployment is waited for
    pods = wait_for(lambda: len(pods_of(cluster, name)) == 4 and pods_of(cluster, name), 60, "4 pods")  # 2 routers
    for pod in pods:  # type: ignore[union-attr]
        set_pod_status(cluster, pod, ready=True)
    st = wait_condition(cluster, name, "Ready", "True", timeout=90)
    assert st["stagesSummary"] == "2/2" and st["stages"][0]["embedded"] is True and "address" not in st["stages"][0]

    def current(o: dict) -> int | None:
        """The one pipeline left (a switch replaces the pipeline: a new revision), if the rollout is over."""
        indexes = {int(m.group(1)) for _, n in o if (m := re.match(rf"{name}-p(\d+)-", n))}
        return indexes.pop() if len(indexes) == 1 else None

    def frontend_args(o: dict, k: int) -> list[str]:
        return o[("Deployment", f"{name}-p{k}-frontend")]["spec"]["template"]["spec"]["containers"][0]["args"]

    with Kubelet(cluster, ns, f"inferencemesh.io/mesh={name}"):
        # off: stage 0 gets its own objects, and the frontend names it as its first stage
        cluster.kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge",
                        "-p", '{"spec":{"frontend":{"embedFirstStage":false}}}')
        objs = wait_for(lambda: (o := children(cluster, name)) and (k := current(o)) is not None
                        and ("Deployment", f"{name}-p{k}-stage-0") in o and o, 90, "stage 0's objects to appear")
        k = current(objs)  # type: ignore[arg-type]
        assert {("Service", f"{name}-p{k}-stage-0"), ("NetworkPolicy", f"{name}-p{k}-stage-0")} <= set(objs)  # type: ignore[arg-type]
        args = frontend_args(objs, k)  # type: ignore[arg-type]
        assert "--first-stage-layers" not in args and len(args[args.index("--stage-addresses") + 1].split(",")) == 2

        # on again: they are pruned
        cluster.kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge",
                        "-p", '{"spec":{"frontend":{"embedFirstStage":true}}}')
        wait_for(lambda: (o := children(cluster, name)) and current(o) is not None
                 and not any(n.endswith("-stage-0") for _, n in o), 90, "stage 0's objects to be pruned")
    cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")


def test_delete_garbage_collects_every_child(cluster: ControlPlane, ns: str) -> None:
    assert children(cluster, "code")
    cluster.kubectl("delete", "inferencemesh", "code", "-n", ns, "--wait=false")
    kinds = CHILD_KINDS + ",replicasets,pods"
    # the garbage collector's first sweep after a new CRD can take ~30 s
    wait_for(lambda: children(cluster, "code", kinds=kinds) == {}, 150, "every child of code to be collected", 2)
