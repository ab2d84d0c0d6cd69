"""Pure status computation and the Events it implies: phases, conditions, Degraded, stable timestamps."""

from __future__ import annotations

import re

from inferencemesh.operator import names as N
from inferencemesh.operator.events import Announcer, transition_events
from inferencemesh.operator.observe import (
    MESSAGE_HEAD,
    RestartWindow,
    deployment_ready,
    observe_pipelines,
    pod_problem,
    restart_window,
)
from inferencemesh.operator.pipelines import Decision
from inferencemesh.operator.planning import Plan, SpeculativeChoice
from inferencemesh.operator.spec import parse_spec
from inferencemesh.operator.status import PlanOutcome
from inferencemesh.operator.status import compute_status as _compute_status
from inferencemesh.planner import StagePlan

SPEC = parse_spec({"model": {"name": "org/m"}})
PLAN = Plan((StagePlan(0, 0, 2, 1, 1, 2, None), StagePlan(1, 2, 4, 1, 1, 2, 2**30)), "local",
            SpeculativeChoice("ngram", "AutoNgram", "why"))
PLANNED = PlanOutcome(PLAN, "True", "Planned", "2 stages")


def mesh(status: dict | None = None, generation: int = 1) -> dict:
    return {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
            "metadata": {"name": "code", "namespace": "ml", "uid": "u", "generation": generation},
            "status": status or {}}


def _labels(name: str) -> dict[str, str]:
    """The labels the renderer gives a child of mesh `code` named `name` (code-p<k>-stage-<i>,
    code-p<k>-frontend, code-router)."""
    labels = {N.LABEL_MESH: "code"}
    m = re.fullmatch(r"code(?:-p(\d+))?-(stage-(\d+)|frontend|router)", name)
    if m is None:
        return labels
    pipeline, what, stage = m.groups()
    labels[N.LABEL_COMPONENT] = "stage" if stage is not None else what
    if stage is not None:
        labels[N.LABEL_STAGE] = stage
    if pipeline is not None:
        labels |= {N.LABEL_PIPELINE: pipeline, N.LABEL_REVISION: "rev1"}
    return labels


def deployment(name: str, ready: int, replicas: int = 1, generation: int = 1) -> dict:
    return {"metadata": {"name": name, "generation": generation, "labels": _labels(name)},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
                       "readyReplicas": ready}}


def pod(name: str, component: str, stage: int | None = None, pipeline: int | None = 0, **status: object) -> dict:
    labels = {N.LABEL_MESH: "code", "app.kubernetes.io/component": component}
    if stage is not None:
        labels["inferencemesh.io/stage"] = str(stage)
    if pipeline is not None:
        labels[N.LABEL_PIPELINE] = str(pipeline)
    return {"metadata": {"name": name, "labels": labels, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Pending", **status}}


ONE = Decision(keep={0: True})  # what pipelines.decide says for one pipeline of the current revision


def compute_status(mesh: dict, spec, outcome, deployments: dict, pods: list, now: str, **kw: object) -> dict:
    """status.compute_status with the decision the reconciler makes for one pipeline (unless given)."""
    kw.setdefault("decision", ONE)
    return _compute_status(mesh, spec, outcome, deployments, pods, now, **kw)


ALL_READY = {"code-p0-stage-0": deployment("code-p0-stage-0", 1), "code-p0-stage-1": deployment("code-p0-stage-1", 1),
             "code-p0-frontend": deployment("code-p0-frontend", 1), "code-router": deployment("code-router", 1)}


def conds(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_fresh_mesh_is_progressing() -> None:
    st = compute_status(mesh(), SPEC, PLANNED, {}, [pod("p0", "stage", 0)], "T1")
    assert st["phase"] == "Progressing" and st["stagesSummary"] == "0/2"
    assert conds(st) == {"Planned": ("True", "Planned"), "StagesReady": ("False", "StagesNotReady"),
                         "FrontendReady": ("False", "FrontendNotReady"), "Ready": ("False", "StagesNotReady"),
                         "Available": ("False", "PipelinesUnavailable"), "Progressing": ("True", "PipelinesStarting"),
                         "Degraded": ("False", "AsExpected")}  # a first start is not a degradation
    assert [s["layers"] for s in st["stages"]] == ["0:2", "2:4"] and st["stages"][0]["pod"] == "p0"
    assert "pod" not in st["stages"][1]  # absent, never "": see status.py
    assert st["stages"][1]["memoryBytes"] == 2**30 and "memoryBytes" not in st["stages"][0]
    assert st["endpoint"] == "http://code-frontend.ml.svc:8000/v1"
    assert st["speculative"] == {"strategy": "ngram", "reason": "AutoNgram", "message": "why"}
    assert all(c["lastTransitionTime"] == "T1" and c["observedGeneration"] == 1 for c in st["conditions"])


def test_all_ready_and_recomputing_changes_nothing() -> None:
    st = compute_status(mesh(), SPEC, PLANNED, ALL_READY, [], "T1")
    assert st["phase"] == "Ready" and conds(st)["Ready"] == ("True", "Ready") and st["stagesSummary"] == "2/2"
    again = compute_status(mesh(st), SPEC, PLANNED, ALL_READY, [], "T2")
    assert again == st  # identical world, identical status (timestamps kept): nothing to write


def test_a_crash_looping_pod_degrades_and_recovery_clears_it() -> None:
    ready = compute_status(mesh(), SPEC, PLANNED, ALL_READY, [], "T1")
    crashing = pod("p1", "stage", 1, containerStatuses=[
        {"name": "stage", "ready": False, "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
    broken = {**ALL_READY, "code-p0-stage-1": deployment("code-p0-stage-1", 0)}
    st = compute_status(mesh(ready), SPEC, PLANNED, broken, [crashing], "T2")
    assert st["phase"] == "Degraded" and conds(st)["Degraded"] == ("True", "PodsFailing")
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert "p1: CrashLoopBackOff (restarts 4)" in degraded["message"]
    assert conds(st)["Ready"] == ("False", "StagesNotReady")
    announcer = Announcer()
    assert [r for r, _, _ in announcer.events("ml/code", {}, ready, "T1")[0]] == ["Ready"]
    events, _ = announcer.events("ml/code", ready, st, "T2")  # a crash is no blink: at once
    assert [(r, k) for r, k, _ in events] == [("Degraded", "Warning")]
    back = compute_status(mesh(st), SPEC, PLANNED, ALL_READY, [], "T3")
    assert back["phase"] == "Ready" and conds(back)["Degraded"] == ("False", "AsExpected")
    assert [r for r, _, _ in announcer.events("ml/code", st, back, "T3")[0]] == ["Recovered"]


def test_a_pipeline_that_served_and_stopped_degrades_the_mesh_until_it_serves_again() -> None:
    ready = compute_status(mesh(), SPEC, PLANNED, ALL_READY, [], "T1")
    lost = {**ALL_READY, "code-p0-frontend": deployment("code-p0-frontend", 0)}
    st = compute_status(mesh(ready), SPEC, PLANNED, lost, [], "T2")
    assert conds(st)["Degraded"] == ("True", "CapacityBelowDesired") and st["phase"] == "Degraded"
    assert conds(st)["Available"] == ("False", "PipelinesUnavailable")
    assert st["pipelines"][0]["state"] == "Degraded" and not st["pipelines"][0]["ready"]
    st2 = compute_status(mesh(st), SPEC, PLANNED, lost, [], "T3")
    assert st2 == st  # sticky (the entry remembers it served), and stable
    # a spec change does not excuse it: it served, so it is not starting
    st3 = compute_status(mesh(st, generation=2), SPEC, PLANNED, lost, [], "T4")
    assert conds(st3)["Degraded"] == ("True", "CapacityBelowDesired")
    back = compute_status(mesh(st), SPEC, PLANNED, ALL_READY, [], "T5")
    assert conds(back)["Degraded"][0] == "False" and conds(back)["Available"] == ("True", "PipelinesServing")


def test_plan_failure_is_terminal_failed_with_reason() -> None:
    failed = PlanOutcome(None, "False", "PlanFailed", "5 stages requested but the model has only 4 layers")
    st = compute_status(mesh(), SPEC, failed, {}, [], "T1")
    assert st["phase"] == "Failed"
    assert conds(st)["Planned"] == ("False", "PlanFailed") and conds(st)["Ready"] == ("False", "PlanFailed")
    assert "endpoint" not in st and st["stages"] == []
    events = transition_events({}, st)
    assert events[0][:2] == ("PlanFailed", "Warning") and "only 4 layers" in events[0][2]
    pending = compute_status(mesh(), SPEC, PlanOutcome(None, "Unknown", "ModelUnavailable", "hub down"), {}, [], "T1")
    assert pending["phase"] == "Pending" and conds(pending)["Planned"] == ("Unknown", "ModelUnavailable")
    assert transition_events({}, pending) == [("ModelUnavailable", "Warning", "hub down")]
    assert transition_events(pending, pending) == []  # retries of the same outcome say nothing new


def test_replan_emits_an_event() -> None:
    st = compute_status(mesh(), SPEC, PLANNED, ALL_READY, [], "T1")
    plan2 = Plan((StagePlan(0, 0, 1, 1, 1, 2, None), StagePlan(1, 1, 4, 1, 1, 2, None)), "local", PLAN.speculative)
    st2 = compute_status(mesh(st), SPEC, PlanOutcome(plan2, "True", "Planned", "2 stages"), ALL_READY, [], "T2")
    assert "Replanned" in [r for r, _, _ in transition_events(st, st2)]


def test_pod_problems_and_deployment_readiness() -> None:
    assert pod_problem(pod("a", "stage", 0)) is None
    assert "failed" in pod_problem(pod("a", "stage", 0, phase="Failed", reason="Evicted"))
    assert "ImagePullBackOff" in pod_problem(pod("a", "frontend", containerStatuses=[
        {"state": {"waiting": {"reason": "ImagePullBackOff"}}}]))
    assert "OOMKilled" in pod_problem(pod("a", "stage", 0, containerStatuses=[
        {"ready": False, "lastState": {"terminated": {"reason": "OOMKilled"}}, "state": {"running": {}}}]))
    assert deployment_ready(deployment("d", 1)) and not deployment_ready(deployment("d", 0))
    stale = deployment("d", 1)
    stale["metadata"]["generation"] = 2  # controller has not seen the new spec yet
    assert not deployment_ready(stale)
    assert not deployment_ready(deployment("d", 0, replicas=0))


def test_scaled_to_zero() -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "replicas": 0})
    st = compute_status(mesh(), spec, PLANNED, {"code-router": deployment("code-router", 1)}, [], "T1",
                        decision=Decision())
    assert conds(st)["FrontendReady"] == ("False", "ScaledToZero") and st["replicas"] == 0
    assert conds(st)["StagesReady"] == ("False", "ScaledToZero") and st["pipelines"] == []
    assert st["selector"] == "inferencemesh.io/mesh=code,app.kubernetes.io/component=frontend"
    assert st["pipelinesSummary"] == "0/0"
    assert "frontendReplicas" not in st and "frontendSelector" not in st  # the old /scale fields are gone


def test_an_embedded_first_stage_is_ready_with_the_frontend_not_a_stage_0_deployment() -> None:
    plan = Plan(PLAN.stages, "local", PLAN.speculative, embedded_first_stage=True)
    outcome = PlanOutcome(plan, "True", "Planned", "2 stages")
    spec = parse_spec({"model": {"name": "org/m"}, "frontend": {"embedFirstStage": True}})
    only_stage_1 = {"code-p0-stage-1": deployment("code-p0-stage-1", 1), "code-router": deployment("code-router", 1)}
    st = compute_status(mesh(), spec, outcome, {**only_stage_1, "code-p0-frontend": deployment("code-p0-frontend", 0)},
                        [pod("f0", "frontend")], "T1")
    assert st["stagesSummary"] == "1/2" and conds(st)["StagesReady"] == ("False", "StagesNotReady")
    message = next(c["message"] for c in st["conditions"] if c["type"] == "StagesReady")
    assert "stage 0 (in the frontend: pod f0 is Pending)" in message
    first = st["stages"][0]
    assert first["embedded"] is True and "address" not in first and first["pod"] == "f0" and not first["ready"]
    assert st["stages"][1]["address"] == "code-p0-stage-1.ml.svc:50051"
    # no stage-0 Deployment exists, and none is waited for
    ready = compute_status(mesh(), spec, outcome,
                           {**only_stage_1, "code-p0-frontend": deployment("code-p0-frontend", 1)}, [], "T1")
    assert ready["phase"] == "Ready" and ready["stagesSummary"] == "2/2" and ready["stages"][0]["ready"]


# ---- the restart budget ------------------------------------------------------------------------

def window_entry(start: str, at_start: int, state: str = "Ready") -> dict:
    return {"index": 0, "state": state, "windowStart": start, "windowRestarts": at_start}


def test_a_restart_window_starts_counts_and_expires() -> None:
    first = restart_window(None, 3, "2026-01-01T00:00:00Z", 600, 5, reset=False)
    assert first == RestartWindow("2026-01-01T00:00:00Z", 3, False)  # restarts before it are not counted
    prev = window_entry(first.start, first.restarts_at_start)
    assert restart_window(prev, 8, "2026-01-01T00:05:00Z", 600, 5, reset=False) == \
        RestartWindow("2026-01-01T00:00:00Z", 3, False)  # 5 restarts: within the budget
    assert restart_window(prev, 9, "2026-01-01T00:05:00Z", 600, 5, reset=False) == \
        RestartWindow("2026-01-01T00:00:00Z", 3, True)  # 6: beyond it
    # the window over: the next one starts at the count then, so the same 6 restarts do not fail it
    assert restart_window(prev, 9, "2026-01-01T00:10:01Z", 600, 5, reset=False) == \
        RestartWindow("2026-01-01T00:10:01Z", 9, False)


def test_a_failed_window_is_sticky_until_reset() -> None:
    failed = window_entry("2026-01-01T00:00:00Z", 3, state="Failed")
    # hours later, with the pods' counts even back to 0: still Failed (kept for debugging)
    assert restart_window(failed, 0, "2026-01-02T00:00:00Z", 600, 5, reset=False) == \
        RestartWindow("2026-01-01T00:00:00Z", 3, True)
    assert restart_window(failed, 20, "2026-01-02T00:00:00Z", 600, 5, reset=True) == \
        RestartWindow("2026-01-02T00:00:00Z", 20, False)


def test_a_replaced_pod_lowers_the_count_at_the_windows_start() -> None:
    prev = window_entry("2026-01-01T00:00:00Z", 10)
    # a pod with 10 restarts was replaced by a fresh one: the count starts again from 0
    assert restart_window(prev, 2, "2026-01-01T00:01:00Z", 600, 5, reset=False) == \
        RestartWindow("2026-01-01T00:00:00Z", 2, False)
    assert restart_window(prev, 0, "2026-01-01T00:01:00Z", 600, 5, reset=False).restarts_at_start == 0
    assert restart_window(window_entry("2026-01-01T00:00:00Z", 0), 6, "2026-01-01T00:02:00Z", 600, 5,
                          reset=False).failed


def crashing_pod(name: str, pipeline: int, stage: int, restarts: int, message: str = "",
                 exit_code: int = 1) -> dict:
    return pod(name, "stage", stage, pipeline=pipeline, containerStatuses=[{
        "name": "stage", "ready": False, "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}}}])


def test_the_budget_resets_on_a_spec_change_and_on_a_new_reset_annotation() -> None:
    from inferencemesh.operator.observe import Observed, pipeline_windows

    spec = parse_spec({"model": {"name": "org/m"}, "restartBudget": {"restarts": 2, "windowSeconds": 600}})
    deps = {"code-p0-stage-0": deployment("code-p0-stage-0", 0), "code-p0-frontend": deployment("code-p0-frontend", 0)}
    pods = [crashing_pod("s0", 0, 0, 9)]

    def windows(m: dict) -> dict:
        return pipeline_windows(m, spec, Observed.of(m, deps, pods), "2026-01-01T01:00:00Z")

    failed = {"observedGeneration": 1, "pipelines": [window_entry("2026-01-01T00:00:00Z", 0, "Failed")]}
    assert windows(mesh(failed))[0].failed  # the same spec, no annotation: still Failed
    assert windows(mesh(failed, generation=2))[0] == RestartWindow("2026-01-01T01:00:00Z", 9, False)
    annotated = mesh(failed)
    annotated["metadata"]["annotations"] = {N.RESET_RESTARTS_ANNOTATION: "1"}
    assert not windows(annotated)[0].failed  # a new value of the annotation: afresh
    # once acted on (status.restartsReset holds the value), the same value resets nothing more
    acted = mesh({**failed, "restartsReset": "1"})
    acted["metadata"]["annotations"] = {N.RESET_RESTARTS_ANNOTATION: "1"}
    assert windows(acted)[0].failed
    st = compute_status(annotated, spec, PLANNED, deps, pods, "T1", windows=windows(annotated))
    assert st["restartsReset"] == "1"


# ---- status.pipelines and the conditions over pipelines ----------------------------------------

def pipeline_deployments(k: int, ready: bool, revision: str = "rev1") -> dict[str, dict]:
    deps = {n: deployment(n, int(ready)) for n in (f"code-p{k}-stage-0", f"code-p{k}-stage-1", f"code-p{k}-frontend")}
    for d in deps.values():
        d["metadata"]["labels"][N.LABEL_REVISION] = revision
    return deps


def test_each_pipeline_has_a_state() -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "replicas": 3})
    deps = {"code-router": deployment("code-router", 1),
            **pipeline_deployments(0, True), **pipeline_deployments(1, False), **pipeline_deployments(2, False),
            **pipeline_deployments(3, False), **pipeline_deployments(4, True, "rev0"),
            **pipeline_deployments(5, True, "rev0")}
    del deps["code-p5-frontend"]  # drained before: only its stages are left
    pods = [crashing_pod("p2s0", 2, 0, 1, "CUDA out of memory"), crashing_pod("p3s0", 3, 0, 12, "boom"),
            pod("p5f", "frontend", pipeline=5)]
    windows = {3: RestartWindow("2026-01-01T00:00:00Z", 0, True)}
    decision = Decision(keep={0: True, 1: True, 2: True, 3: False}, old=[4], drain=[5])
    st = compute_status(mesh(), spec, PLANNED, deps, pods, "T1", decision=decision, windows=windows)
    states = {p["index"]: p["state"] for p in st["pipelines"]}
    assert states == {0: "Ready", 1: "Progressing", 2: "Degraded", 3: "Failed", 4: "Outdated", 5: "Draining"}
    by_index = {p["index"]: p for p in st["pipelines"]}
    assert by_index[0]["ready"] and not by_index[3]["ready"] and not by_index[5]["ready"]
    assert by_index[0]["name"] == "code-p0" and by_index[4]["revision"] == "rev0"
    assert by_index[3]["restarts"] == 12 and by_index[3]["windowRestarts"] == 0
    assert "CrashLoopBackOff" in by_index[2]["message"]
    # status.replicas counts the ready pipelines of the current revision (not the Outdated one)
    assert st["replicas"] == 1 and st["pipelinesSummary"] == "1/3 (1 failed)"
    assert st["selector"] == N.selector_text(N.frontends_selector("code"))
    assert conds(st)["Degraded"] == ("True", "PipelineFailed") and st["phase"] == "Degraded"
    # a removed pipeline (decision.remove) is gone from status.pipelines
    gone = compute_status(mesh(), spec, PLANNED, deps, pods, "T1", windows=windows,
                          decision=Decision(keep={0: True, 1: True, 2: True, 3: False}, old=[4], remove=[5]))
    assert 5 not in {p["index"] for p in gone["pipelines"]}


def test_a_failed_pipeline_is_degraded_quoting_the_head_of_the_termination_message() -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "replicas": 2})
    message = "RuntimeError: " + "x" * 400 + "\nTraceback (most recent call last):\n  File ..."
    deps = {"code-router": deployment("code-router", 1), **pipeline_deployments(0, True),
            **pipeline_deployments(1, False)}
    pods = [crashing_pod("code-p1-stage-1-abc", 1, 1, 7, message, exit_code=3)]
    windows = {0: RestartWindow("T0", 0, False), 1: RestartWindow("T0", 0, True)}
    st = compute_status(mesh(), spec, PLANNED, deps, pods, "T1", decision=Decision(keep={0: True, 1: False}),
                        windows=windows)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PipelineFailed")
    head = "RuntimeError: " + "x" * (MESSAGE_HEAD - len("RuntimeError: "))
    assert f"pod code-p1-stage-1-abc exited 3: {head}" in degraded["message"]
    assert head + "x" not in degraded["message"] and "Traceback" not in degraded["message"]
    assert "pipeline 1 failed: 7 restarts" in degraded["message"]
    failed = st["pipelines"][1]
    assert failed["state"] == "Failed" and head in failed["message"]
    # the other pipeline serves: stages and frontend are ready over the current (non-failed) pipelines
    assert conds(st)["StagesReady"][0] == "True" and conds(st)["FrontendReady"][0] == "True"
    assert conds(st)["Ready"] == ("False", "PipelinesNotReady")
    assert st["replicas"] == 1 and st["pipelinesSummary"] == "1/2 (1 failed)"
    assert ("RestartBudgetExhausted", "Warning") in [(r, k) for r, k, _ in transition_events({}, st)]
    assert transition_events(st, st) == []  # said once
    assert [(r, k) for r, k, _ in Announcer().events("ml/code", {}, st, "T1")[0]] == [("Degraded", "Warning")]


def test_two_ready_pipelines_are_ready_and_the_summary_counts_them() -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "replicas": 2})
    deps = {"code-router": deployment("code-router", 1), **pipeline_deployments(0, True),
            **pipeline_deployments(1, True)}
    two = Decision(keep={0: True, 1: True})
    st = compute_status(mesh(), spec, PLANNED, deps, [], "T1", decision=two)
    assert st["phase"] == "Ready" and st["replicas"] == 2 and st["pipelinesSummary"] == "2/2"
    assert st["stagesSummary"] == "2/2"
    assert [p["state"] for p in st["pipelines"]] == ["Ready", "Ready"]
    # one of two not ready: the mesh is not Ready, and says which pipeline waits
    half = {**deps, "code-p1-frontend": deployment("code-p1-frontend", 0)}
    st = compute_status(mesh(), spec, PLANNED, half, [], "T1", decision=two)
    assert st["replicas"] == 1 and st["pipelinesSummary"] == "1/2"
    assert conds(st)["FrontendReady"] == ("False", "FrontendNotReady") and conds(st)["Ready"][0] == "False"
    assert "pipeline 1" in next(c["message"] for c in st["conditions"] if c["type"] == "FrontendReady")


def test_frontend_ready_needs_the_router() -> None:
    no_router = {k: v for k, v in ALL_READY.items() if k != "code-router"}
    st = compute_status(mesh(), SPEC, PLANNED, no_router, [], "T1")
    assert conds(st)["FrontendReady"] == ("False", "RouterNotReady")
    assert conds(st)["StagesReady"] == ("True", "AllStagesReady") and conds(st)["Ready"] == ("False", "RouterNotReady")
    assert st["replicas"] == 1  # the pipeline itself is ready
    unready = {**no_router, "code-router": deployment("code-router", 0)}
    assert conds(compute_status(mesh(), SPEC, PLANNED, unready, [], "T1"))["FrontendReady"] == \
        ("False", "RouterNotReady")


def test_observe_pipelines_groups_children_by_the_pipeline_label() -> None:
    deps = [deployment(n, 1) for n in ("code-p0-stage-0", "code-p0-frontend", "code-p1-frontend", "code-router")]
    found = observe_pipelines(deps, [pod("f", "frontend", pipeline=1), pod("unlabelled", "stage", 0, pipeline=None)])
    assert sorted(found) == [0, 1]  # the router belongs to no pipeline, nor does a child without the label
    assert sorted(found[0].deployments) == ["code-p0-frontend", "code-p0-stage-0"] and found[0].revision == "rev1"
    assert [p["metadata"]["name"] for p in found[1].frontend_pods] == ["f"]

def _empty_strings(value: object, path: str = "status") -> list[str]:
    if value == "":
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _empty_strings(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _empty_strings(v, f"{path}[{i}]")]
    return []


def test_a_pipeline_with_no_object_yet_has_no_revision_and_the_status_holds_no_empty_string() -> None:
    """An empty string anywhere in the status makes kube-apiserver 1.20's merge patch store null and
    refuse it all."""
    st = compute_status(mesh(), SPEC, PLANNED, {"code-router": deployment("code-router", 1)}, [], "T1",
                        decision=Decision(keep={0: True}), windows={0: RestartWindow("T0", 0, False)})
    (entry,) = st["pipelines"]
    assert entry["state"] == "Progressing" and entry["name"] == "code-p0" and "revision" not in entry
    assert _empty_strings(st) == []

def test_a_kept_pipeline_without_its_frontend_yet_is_progressing_not_draining() -> None:
    deps = {"code-router": deployment("code-router", 1), "code-p0-stage-0": deployment("code-p0-stage-0", 0),
            "code-p0-stage-1": deployment("code-p0-stage-1", 0)}
    st = compute_status(mesh(), SPEC, PLANNED, deps, [], "T1")  # the decision keeps pipeline 0
    assert [(p["index"], p["state"]) for p in st["pipelines"]] == [(0, "Progressing")]
    drained = compute_status(mesh(), SPEC, PLANNED, deps, [], "T1", decision=Decision(drain=[0]))
    assert [(p["index"], p["state"]) for p in drained["pipelines"]] == [(0, "Draining")]
