"""Pure status computation and the Events it implies: phases, conditions, Degraded, stable timestamps."""

from __future__ import annotations

from inferencemesh.operator.planning import Plan, SpeculativeChoice
from inferencemesh.operator.reconcile import transition_events
from inferencemesh.operator.spec import parse_spec
from inferencemesh.operator.status import PlanOutcome, compute_status, deployment_ready, pod_problem
from inferencemesh.planner import StagePlan

SPEC = parse_spec({"model": {"name": "org/m"}})
PLAN = Plan((StagePlan(0, 0, 2, 1, 1, 2, None), StagePlan(1, 2, 4, 1, 1, 2, 2**30)), "local",
            SpeculativeChoice("ngram", "AutoNgram", "why"))
PLANNED = PlanOutcome(PLAN, "True", "Planned", "2 stages")


def mesh(status: dict | None = None, generation: int = 1) -> dict:
    return {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
            "metadata": {"name": "code", "namespace": "ml", "uid": "u", "generation": generation},
            "status": status or {}}


def deployment(name: str, ready: int, replicas: int = 1, generation: int = 1) -> dict:
    return {"metadata": {"name": name, "generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
                       "readyReplicas": ready}}


def pod(name: str, component: str, stage: int | None = None, **status: object) -> dict:
    labels = {"app.kubernetes.io/component": component}
    if stage is not None:
        labels["inferencemesh.io/stage"] = str(stage)
    return {"metadata": {"name": name, "labels": labels, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Pending", **status}}


ALL_READY = {"code-stage-0": deployment("code-stage-0", 1), "code-stage-1": deployment("code-stage-1", 1),
             "code-frontend": deployment("code-frontend", 1)}


def conds(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_fresh_mesh_is_progressing() -> None:
    st = compute_status(mesh(), SPEC, PLANNED, {}, [pod("p0", "stage", 0)], "T1")
    assert st["phase"] == "Progressing" and st["stagesSummary"] == "0/2"
    assert conds(st) == {"Planned": ("True", "Planned"), "StagesReady": ("False", "StagesNotReady"),
                         "FrontendReady": ("False", "NoFrontend"), "Ready": ("False", "StagesNotReady"),
                         "Degraded": ("False", "AsExpected")}
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
    broken = {**ALL_READY, "code-stage-1": deployment("code-stage-1", 0)}
    st = compute_status(mesh(ready), SPEC, PLANNED, broken, [crashing], "T2")
    assert st["phase"] == "Degraded" and conds(st)["Degraded"] == ("True", "PodsFailing")
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert "p1: CrashLoopBackOff (restarts 4)" in degraded["message"]
    assert conds(st)["Ready"] == ("False", "StagesNotReady")
    events = transition_events(ready, st)
    assert ("Degraded", "Warning") in [(r, k) for r, k, _ in events]
    back = compute_status(mesh(st), SPEC, PLANNED, ALL_READY, [], "T3")
    assert back["phase"] == "Ready" and conds(back)["Degraded"] == ("False", "AsExpected")
    reasons = [r for r, _, _ in transition_events(st, back)]
    assert "Recovered" in reasons and "Ready" in reasons


def test_lost_readiness_without_spec_change_is_degraded_until_ready_again() -> None:
    ready = compute_status(mesh(), SPEC, PLANNED, ALL_READY, [], "T1")
    lost = {**ALL_READY, "code-stage-0": deployment("code-stage-0", 0)}
    st = compute_status(mesh(ready), SPEC, PLANNED, lost, [], "T2")
    assert conds(st)["Degraded"] == ("True", "ReadinessLost")
    st2 = compute_status(mesh(st), SPEC, PLANNED, lost, [], "T3")
    assert conds(st2)["Degraded"] == ("True", "ReadinessLost") and st2 == st  # sticky, and stable
    # a spec change (new generation) is a rollout, not degradation
    st3 = compute_status(mesh(ready, generation=2), SPEC, PLANNED, lost, [], "T4")
    assert conds(st3)["Degraded"] == ("False", "AsExpected") and st3["phase"] == "Progressing"


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


def test_scaled_to_zero_frontend() -> None:
    spec = parse_spec({"model": {"name": "org/m"}, "frontend": {"replicas": 0}})
    deps = {**ALL_READY, "code-frontend": deployment("code-frontend", 0, replicas=0)}
    st = compute_status(mesh(), spec, PLANNED, deps, [], "T1")
    assert conds(st)["FrontendReady"] == ("False", "ScaledToZero") and st["frontendReplicas"] == 0
    assert st["frontendSelector"] == "inferencemesh.io/mesh=code,app.kubernetes.io/component=frontend"


def test_an_embedded_first_stage_is_ready_with_the_frontend_not_a_stage_0_deployment() -> None:
    plan = Plan(PLAN.stages, "local", PLAN.speculative, embedded_first_stage=True)
    outcome = PlanOutcome(plan, "True", "Planned", "2 stages")
    spec = parse_spec({"model": {"name": "org/m"}, "frontend": {"embedFirstStage": True}})
    only_stage_1 = {"code-stage-1": deployment("code-stage-1", 1)}
    st = compute_status(mesh(), spec, outcome, {**only_stage_1, "code-frontend": deployment("code-frontend", 0)},
                        [pod("f0", "frontend")], "T1")
    assert st["stagesSummary"] == "1/2" and conds(st)["StagesReady"] == ("False", "StagesNotReady")
    message = next(c["message"] for c in st["conditions"] if c["type"] == "StagesReady")
    assert "stage 0 (in the frontend: pod f0 is Pending)" in message
    first = st["stages"][0]
    assert first["embedded"] is True and "address" not in first and first["pod"] == "f0" and not first["ready"]
    assert st["stages"][1]["address"] == "code-stage-1.ml.svc:50051"
    ready = compute_status(mesh(), spec, outcome, {**only_stage_1, "code-frontend": deployment("code-frontend", 1)},
                           [], "T1")  # no stage-0 Deployment exists, and none is waited for
    assert ready["phase"] == "Ready" and ready["stagesSummary"] == "2/2" and ready["stages"][0]["ready"]
