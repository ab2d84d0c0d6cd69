"""Pipelines against a real kube-apiserver + controllers, the operator under the chart's RBAC (see
conftest.py): the /scale subresource, draining on a scale-down, a crash loop beyond the restart
budget, the migration of a mesh from before pipelines. Tests play kubelet (imesh_k8s.Kubelet); a
finalizer of the test's own holds a terminating pod, as a kubelet would while the pod drains."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from imesh_k8s import ControlPlane, Kubelet, OperatorProcess, patch_pod_status, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
NS = "mesh-pipelines"
GROUP, VERSION, PLURAL = "inferencemesh.io", "v1alpha1", "inferencemeshes"
HOLD = "test.inferencemesh.io/hold"  # a finalizer: the pod stays terminating until the test lets it go


@pytest.fixture(scope="module")
def ns(cluster: ControlPlane, operator: OperatorProcess) -> str:
    cluster.kubectl("create", "namespace", NS)
    return NS


@pytest.fixture(scope="module")
def api(cluster: ControlPlane) -> Iterator[object]:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield client.CustomObjectsApi(api_client)
    finally:
        api_client.close()


def mesh_doc(name: str, spec: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceMesh", "metadata": {"name": name}, "spec": spec}


def status_of(cluster: ControlPlane, name: str) -> dict:
    return cluster.get_json("inferencemesh", name, "-n", NS).get("status") or {}


def cond(status: dict, ctype: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c["type"] == ctype), {})


def states(status: dict) -> dict[int, str]:
    return {p["index"]: p["state"] for p in status.get("pipelines") or []}


def deployments(cluster: ControlPlane, base: str) -> dict[str, dict]:
    items = cluster.get_json("deployments", "-n", NS, "-l", f"inferencemesh.io/mesh={base}")["items"]
    return {d["metadata"]["name"]: d for d in items}


def objects(cluster: ControlPlane, base: str) -> set[tuple[str, str]]:
    items = cluster.get_json("deployments,services,networkpolicies,secrets", "-n", NS,
                             "-l", f"inferencemesh.io/mesh={base}")["items"]
    return {(o["kind"], o["metadata"]["name"]) for o in items}


def pods(cluster: ControlPlane, selector: str) -> list[dict]:
    return cluster.get_json("pods", "-n", NS, "-l", selector)["items"]


def hold_pods(cluster: ControlPlane, selector: str) -> list[str]:
    """Put the test's finalizer on the pods matching `selector`: once deleted, they stay terminating."""
    names = [p["metadata"]["name"] for p in pods(cluster, selector)]
    for name in names:
        cluster.kubectl("patch", "pod", name, "-n", NS, "--type=merge",
                        "-p", json.dumps({"metadata": {"finalizers": [HOLD]}}))
    return names


def release_pods(cluster: ControlPlane, names: list[str]) -> None:
    for name in names:
        cluster.kubectl("patch", "pod", name, "-n", NS, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)


def identity(dep: dict) -> tuple[str, int]:
    """What changes when the operator replaces or recreates a Deployment (not when its pods do)."""
    return dep["metadata"]["uid"], dep["metadata"]["generation"]


def test_scale_subresource_sets_the_pipelines_and_a_scale_down_drains_first(
        cluster: ControlPlane, ns: str, api: object, tiny_model: Path) -> None:
    name = "sc"
    cluster.apply(mesh_doc(name, {"model": {"name": str(tiny_model)}, "stages": {"count": 2}}), ns)
    with Kubelet(cluster, ns, f"inferencemesh.io/mesh={name}"):
        wait_for(lambda: cond(status_of(cluster, name), "Ready").get("status") == "True", 90, "sc Ready")
        scale = api.get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name)  # type: ignore[attr-defined]
        assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
        p0 = {n: identity(d) for n, d in deployments(cluster, name).items() if n.startswith("sc-p0-")}
        assert sorted(p0) == ["sc-p0-frontend", "sc-p0-stage-0", "sc-p0-stage-1"]

        api.patch_namespaced_custom_object_scale(  # type: ignore[attr-defined]
            GROUP, VERSION, ns, PLURAL, name, {"spec": {"replicas": 2}})
        assert cluster.get_json("inferencemesh", name, "-n", ns)["spec"]["replicas"] == 2
        wanted = {(k, f"sc-p1-stage-{i}") for i in range(2) for k in ("Deployment", "Service", "NetworkPolicy")} \
            | {("Deployment", "sc-p1-frontend"), ("Secret", "sc-p1-frontend-tls"), ("Secret", "sc-p1-stage-0-tls")}
        wait_for(lambda: wanted <= objects(cluster, name), 60, "pipeline 1's objects")
        wait_for(lambda: status_of(cluster, name).get("replicas") == 2, 90, "status.replicas == 2")
        scale = api.get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name)  # type: ignore[attr-defined]
        st = status_of(cluster, name)
        assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
        assert scale["status"]["selector"] == st["selector"] == \
            f"inferencemesh.io/mesh={name},app.kubernetes.io/component=frontend"
        assert len(pods(cluster, scale["status"]["selector"])) == 2  # one frontend pod per pipeline
        assert st["pipelinesSummary"] == "2/2" and states(st) == {0: "Ready", 1: "Ready"}

        # 2 -> 1: pipeline 1 drains; its frontend pod is held terminating (as while it finishes requests)
        held = hold_pods(cluster, f"inferencemesh.io/mesh={name},inferencemesh.io/pipeline=1,"
                                  "app.kubernetes.io/component=frontend")
        assert len(held) == 1
        try:
            api.patch_namespaced_custom_object_scale(  # type: ignore[attr-defined]
                GROUP, VERSION, ns, PLURAL, name, {"spec": {"replicas": 1}})
            wait_for(lambda: "sc-p1-frontend" not in deployments(cluster, name), 60, "p1's frontend Deployment to go")
            wait_for(lambda: states(status_of(cluster, name)).get(1) == "Draining", 30, "pipeline 1 Draining")
            time.sleep(7)  # beyond the operator's drain poll (5 s): its stages must still be there
            left = objects(cluster, name)
            assert {("Deployment", "sc-p1-stage-0"), ("Deployment", "sc-p1-stage-1"),
                    ("Service", "sc-p1-stage-1")} <= left
            p1_frontend = (f"inferencemesh.io/mesh={name},inferencemesh.io/pipeline=1,"
                           "app.kubernetes.io/component=frontend")
            wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in pods(cluster, p1_frontend)), 30,
                     "p1's frontend pod terminating")
        finally:
            release_pods(cluster, held)
        wait_for(lambda: not any(n.startswith("sc-p1-") for _, n in objects(cluster, name)), 60,
                 "pipeline 1's stages (and certificates) to go once its frontend pod is gone")
        st = wait_for(lambda: (s := status_of(cluster, name)) and states(s) == {0: "Ready"} and s, 30,
                      "one pipeline left")
        assert st["replicas"] == 1 and st["pipelinesSummary"] == "1/1"
        assert {n: identity(d) for n, d in deployments(cluster, name).items() if n.startswith("sc-p0-")} == p0
    cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")


def test_a_crash_loop_beyond_the_budget_fails_only_its_pipeline(cluster: ControlPlane, ns: str,
                                                                tiny_model: Path) -> None:
    name = "cr"
    cluster.apply(mesh_doc(name, {"model": {"name": str(tiny_model)}, "stages": {"count": 2}, "replicas": 2,
                                  "restartBudget": {"restarts": 3, "windowSeconds": 600}}), ns)
    with Kubelet(cluster, ns, f"inferencemesh.io/mesh={name}") as kubelet:
        wait_for(lambda: status_of(cluster, name).get("replicas") == 2, 90, "two ready pipelines")
        p0 = {n: identity(d) for n, d in deployments(cluster, name).items() if n.startswith("cr-p0-")}
        assert len(p0) == 3
        kubelet.hold.add("cr-p1-stage-1-")
        (crashing,) = pods(cluster, f"inferencemesh.io/mesh={name},inferencemesh.io/pipeline=1,"
                                    "inferencemesh.io/stage=1")
        message = "RuntimeError: CUDA error: out of memory\nTraceback (most recent call last):\n  ..."
        patch_pod_status(cluster, crashing, NS, ready=False, waiting="CrashLoopBackOff", restarts=2,
                         terminated_message=message)
        st = wait_for(lambda: (s := status_of(cluster, name)) and cond(s, "Degraded").get("reason") == "PodsFailing"
                      and s, 60, "Degraded PodsFailing within the budget")
        assert states(st)[1] == "Degraded"
        patch_pod_status(cluster, crashing, NS, ready=False, waiting="CrashLoopBackOff", restarts=5,
                         terminated_message=message)
        st = wait_for(lambda: (s := status_of(cluster, name)) and states(s).get(1) == "Failed" and s, 60,
                      "pipeline 1 Failed")
        degraded = cond(st, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "PipelineFailed")
        assert "RuntimeError: CUDA error: out of memory" in degraded["message"] and "Traceback" not in \
            degraded["message"]
        entry = next(p for p in st["pipelines"] if p["index"] == 1)
        assert entry["restarts"] == 5 and "RuntimeError: CUDA error: out of memory" in entry["message"]
        assert st["pipelinesSummary"] == "1/2 (1 failed)" and st["phase"] == "Degraded"
        wait_for(lambda: deployments(cluster, name)["cr-p1-frontend"]["spec"]["replicas"] == 0, 30,
                 "the failed pipeline's frontend scaled to zero")
        assert "cr-p1-stage-1" in deployments(cluster, name)  # kept for debugging
        wait_for(lambda: status_of(cluster, name).get("replicas") == 1, 30, "status.replicas == 1")
        time.sleep(2)
        assert {n: identity(d) for n, d in deployments(cluster, name).items() if n.startswith("cr-p0-")} == p0
        assert states(status_of(cluster, name)) == {0: "Ready", 1: "Failed"}
        # Failed is sticky: the pod looking well again does not lift it (a reset does)
        patch_pod_status(cluster, crashing, NS, ready=True, restarts=5)
        time.sleep(3)
        assert states(status_of(cluster, name))[1] == "Failed"
        kubelet.hold.clear()
        cluster.kubectl("annotate", "inferencemesh", name, "-n", ns, "inferencemesh.io/reset-restarts=1")
        wait_for(lambda: states(status_of(cluster, name)) == {0: "Ready", 1: "Ready"}, 60,
                 "the reset to lift the failure")
        assert deployments(cluster, name)["cr-p1-frontend"]["spec"]["replicas"] == 1
        assert status_of(cluster, name)["restartsReset"] == "1"
    cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")


def owner_uids(dep: dict) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for ref in dep["metadata"].get("ownerReferences") or []:
        found.setdefault(ref["kind"], set()).add(ref["uid"])
    return found


def test_deleting_the_mesh_removes_stages_and_router_after_the_frontends(cluster: ControlPlane, ns: str,
                                                                         tiny_model: Path) -> None:
    """The garbage collector's order, with no finalizer: a frontend pod still draining keeps its
    pipeline's stages and the router; they go once it has."""
    name = "dl"
    cluster.apply(mesh_doc(name, {"model": {"name": str(tiny_model)}, "stages": {"count": 2}, "replicas": 2}), ns)
    frontends = f"inferencemesh.io/mesh={name},app.kubernetes.io/component=frontend"
    with Kubelet(cluster, ns, f"inferencemesh.io/mesh={name}"):
        wait_for(lambda: status_of(cluster, name).get("replicas") == 2, 90, "two ready pipelines")
        pod_uid = {int(p["metadata"]["labels"]["inferencemesh.io/pipeline"]): p["metadata"]["uid"]
                   for p in pods(cluster, frontends)}
        mesh_uid = cluster.get_json("inferencemesh", name, "-n", ns)["metadata"]["uid"]
        wait_for(lambda: owner_uids(deployments(cluster, name)["dl-router"]).get("Pod") == set(pod_uid.values()),
                 30, "the router owned by both frontend pods")
        deps = deployments(cluster, name)
        for k in (0, 1):
            for i in (0, 1):
                assert owner_uids(deps[f"dl-p{k}-stage-{i}"]) == {"InferenceMesh": {mesh_uid}, "Pod": {pod_uid[k]}}
        assert owner_uids(deps[f"dl-p{k}-frontend"]) == {"InferenceMesh": {mesh_uid}}
        held = hold_pods(cluster, frontends)
        assert len(held) == 2
        try:
            cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")
            wait_for(lambda: not {"dl-p0-frontend", "dl-p1-frontend"} & set(deployments(cluster, name)), 60,
                     "the frontend Deployments to go")
            wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in pods(cluster, frontends)), 30,
                     "the frontend pods terminating")
            time.sleep(5)  # the garbage collector has had its turn: the frontends' pods still hold the rest
            assert {"dl-p0-stage-0", "dl-p0-stage-1", "dl-p1-stage-0", "dl-p1-stage-1", "dl-router"} <= \
                set(deployments(cluster, name))
            release_pods(cluster, held[:1])  # one pipeline done draining: its stages go, the router stays
            wait_for(lambda: len(pods(cluster, frontends)) == 1, 30, "one frontend pod gone")
            (left,) = [int(p["metadata"]["labels"]["inferencemesh.io/pipeline"]) for p in pods(cluster, frontends)]
            gone = 1 - left
            wait_for(lambda: not any(n.startswith(f"dl-p{gone}-") for n in deployments(cluster, name)), 60,
                     f"pipeline {gone}'s stages to go after its frontend")
            assert {f"dl-p{left}-stage-0", f"dl-p{left}-stage-1", "dl-router"} <= set(deployments(cluster, name))
        finally:
            release_pods(cluster, held)
        wait_for(lambda: not deployments(cluster, name), 60, "every Deployment to go after the last frontend")


class ServingWatch:
    """Samples, in a thread, how many frontend pods of a mesh serve (ready, not terminating) and the
    mesh's Available and Degraded conditions, until stopped: the fewest seen and every condition seen."""

    def __init__(self, cluster: ControlPlane, name: str) -> None:
        import threading

        self.cluster, self.name = cluster, name
        self.fewest: int | None = None
        self.seen: set[tuple[str, str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ServingWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        frontends = f"inferencemesh.io/mesh={self.name},app.kubernetes.io/component=frontend"
        while not self._stop.is_set():
            serving = sum(1 for p in pods(self.cluster, frontends) if not p["metadata"].get("deletionTimestamp")
                          and any(c["type"] == "Ready" and c["status"] == "True"
                                  for c in (p.get("status") or {}).get("conditions") or []))
            self.fewest = serving if self.fewest is None else min(self.fewest, serving)
            st = status_of(self.cluster, self.name)
            self.seen |= {(c["type"], c["status"], c.get("reason", "")) for c in st.get("conditions") or []}
            self._stop.wait(0.2)


def test_a_spec_change_rolls_one_pipeline_at_a_time_through_a_stage_blink(cluster: ControlPlane, ns: str,
                                                                         tiny_model: Path) -> None:
    """The review's outage: a spec change while a stage of an old pipeline is not ready (its frontend
    still serving) drained both old pipelines at once. Now: never fewer than 2 frontends serving, a
    status that shows the rollout's revision and step, and events for each step."""
    name = "ro"
    spec = {"model": {"name": str(tiny_model)}, "stages": {"count": 2}, "replicas": 2}
    cluster.apply(mesh_doc(name, spec), ns)
    with Kubelet(cluster, ns, f"inferencemesh.io/mesh={name}") as kubelet:
        st = wait_for(lambda: (s := status_of(cluster, name)) and s.get("replicas") == 2
                      and cond(s, "Progressing").get("reason") == "Complete" and s, 90, "two serving pipelines")
        assert (cond(st, "Available")["status"], cond(st, "Available")["message"]) == ("True", "2/2 pipelines serving")
        old_revision = st["pipelines"][0]["revision"]
        kubelet.hold.add("ro-p0-stage-1-")  # pipeline 0's stage 1 turns unready (its frontend still serves)
        (stage,) = pods(cluster, f"inferencemesh.io/mesh={name},inferencemesh.io/pipeline=0,inferencemesh.io/stage=1")
        patch_pod_status(cluster, stage, NS, ready=False)
        wait_for(lambda: cond(status_of(cluster, name), "StagesReady").get("status") == "False", 30, "the blink seen")
        kubelet.hold.add("ro-p2-frontend-")  # the first new pipeline does not serve until the test says so
        with ServingWatch(cluster, name) as watch:
            cluster.apply(mesh_doc(name, {**spec, "frontend": {"maxBatchTokens": 192}}), ns)
            rolling = wait_for(lambda: (s := status_of(cluster, name)) and
                               cond(s, "Progressing").get("reason") == "RollingOut" and s, 30, "the rollout")
            assert cond(rolling, "Progressing")["message"] == \
                f"rolling to revision {rolling['pipelines'][-1]['revision']}: 0/2 pipelines replaced"
            wait_for(lambda: "ro-p2-frontend" in deployments(cluster, name), 30, "the first new pipeline")
            time.sleep(3)  # reconciles go by (pod events wake them): one new pipeline, both old ones serving
            names = set(deployments(cluster, name))
            assert {"ro-p0-frontend", "ro-p1-frontend"} <= names and not any(n.startswith("ro-p3-") for n in names)
            kubelet.hold.discard("ro-p2-frontend-")
            # the Ready condition (every stage pod ready) can trail Progressing's Complete by a
            # reconcile on a loaded machine: the end is both
            st = wait_for(lambda: (s := status_of(cluster, name)) and states(s) == {2: "Ready", 3: "Ready"}
                          and cond(s, "Progressing").get("reason") == "Complete" and s["phase"] == "Ready" and s,
                          120, "the rollout's end")
        assert watch.fewest is not None and watch.fewest >= 2, f"only {watch.fewest} frontends served at one point"
        assert ("Degraded", "True", "CapacityBelowDesired") not in watch.seen and \
            ("Available", "False", "PipelinesUnavailable") not in watch.seen
        assert {p["revision"] for p in st["pipelines"]} != {old_revision}
        assert (cond(st, "Available")["status"], cond(st, "Available")["message"]) == ("True", "2/2 pipelines serving")
        assert st["phase"] == "Ready" and cond(st, "Degraded")["status"] == "False"
        reasons = wait_for(lambda: (r := [e["reason"] for e in cluster.get_json(
            "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]])
            and "RolloutFinished" in r and r, 30, "the rollout's events")
        assert {"RolloutStarted", "PipelineStarted", "PipelineDrained", "RolloutFinished"} <= set(reasons)
        assert reasons.count("PipelineDrained") == 2 and reasons.count("PipelineStarted") == 2
        assert not {"Degraded", "Recovered"} & set(reasons)
    cluster.kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=false")
