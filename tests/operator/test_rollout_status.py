"""The status and Events of a rollout, as pure functions: Available, Progressing (its revision and
step, its deadline), a not-ready stage's probe message, the action Events, and Ready/Degraded Events
that wait until a change has lasted (no event for a blink)."""

from __future__ import annotations

from test_status import (
    ALL_READY,
    PLANNED,
    conds,
    deployment,
    mesh,
    pipeline_deployments,
    pod,
)

from inferencemesh.operator.events import SETTLE_SECONDS, Announcer, action_events, transition_events
from inferencemesh.operator.observe import Observed
from inferencemesh.operator.pipelines import PROGRESS_DEADLINE_SECONDS, Decision
from inferencemesh.operator.spec import parse_spec
from inferencemesh.operator.status import compute_status

SPEC2 = parse_spec({"model": {"name": "org/m"}, "replicas": 2})
T0 = "2026-01-01T00:00:00Z"


def at(seconds: int) -> str:
    return f"2026-01-01T{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"


def message(st: dict, ctype: str) -> str:
    return next(c["message"] for c in st["conditions"] if c["type"] == ctype)


def pipeline(k: int, serving: bool, revision: str, created: str = T0) -> dict[str, dict]:
    deps = pipeline_deployments(k, serving, revision)
    for d in deps.values():
        d["metadata"]["creationTimestamp"] = created
    return deps


def unready_stage_pod(name: str, k: int, stage: int) -> dict:
    return pod(name, "stage", stage, pipeline=k, phase="Running", conditions=[
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
         "message": "containers with unready status: [stage]"}],
        containerStatuses=[{"name": "stage", "ready": False, "restartCount": 0, "state": {"running": {}}}])


ROUTER = {"code-router": deployment("code-router", 1)}


def test_a_rollout_reports_its_revision_and_step_and_stays_available() -> None:
    old = {**ROUTER, **pipeline(0, True, "rev1"), **pipeline(1, True, "rev1")}
    steady = compute_status(mesh(), SPEC2, PLANNED, old, [], T0, decision=Decision(keep={0: True, 1: True}),
                            revision="rev1")
    assert conds(steady)["Progressing"] == ("False", "Complete") and message(steady, "Available") == \
        "2/2 pipelines serving"
    # the spec changes: pipeline 2 of rev2 starts beside the two old ones
    world = {**old, **pipeline(2, False, "rev2")}
    st = compute_status(mesh(steady), SPEC2, PLANNED, world, [], at(10), revision="rev2",
                        decision=Decision(keep={2: True}, old=[0, 1]))
    assert conds(st)["Progressing"] == ("True", "RollingOut")
    assert message(st, "Progressing") == "rolling to revision rev2: 0/2 pipelines replaced"
    assert conds(st)["Available"] == ("True", "PipelinesServing") and message(st, "Available") == \
        "2/2 pipelines serving"
    assert conds(st)["Degraded"][0] == "False" and st["phase"] != "Degraded"
    assert [r for r, _, _ in transition_events(steady, st)] == ["RolloutStarted"]
    # one replaced, one old draining
    world = {**old, **pipeline(2, True, "rev2"), **pipeline(3, False, "rev2")}
    del world["code-p1-frontend"]
    st2 = compute_status(mesh(st), SPEC2, PLANNED, world, [pod("f1", "frontend", pipeline=1)], at(20),
                         revision="rev2", decision=Decision(keep={2: True, 3: True}, old=[0], drain=[1]))
    assert message(st2, "Progressing") == "rolling to revision rev2: 1/2 pipelines replaced, 1 old draining"
    assert transition_events(st, st2) == []
    done = {**ROUTER, **pipeline(2, True, "rev2"), **pipeline(3, True, "rev2")}
    st3 = compute_status(mesh(st2), SPEC2, PLANNED, done, [], at(30), revision="rev2",
                         decision=Decision(keep={2: True, 3: True}))
    assert conds(st3)["Progressing"] == ("False", "Complete") and st3["phase"] == "Ready"
    assert [r for r, _, _ in transition_events(st2, st3)] == ["RolloutFinished"]


def test_a_new_pipeline_not_serving_past_the_deadline_stops_the_rollout_saying_why() -> None:
    world = {**ROUTER, **pipeline(0, True, "rev1"), **pipeline(1, True, "rev1"), **pipeline(2, False, "rev2")}
    world["code-p2-stage-0"]["status"]["readyReplicas"] = 1  # its stage 1 is the one that does not come up
    probe = {"code-p2-stage-1-x": "Readiness probe failed: timeout: health rpc did not complete within 1s"}
    pods = [unready_stage_pod("code-p2-stage-1-x", 2, 1)]
    decision = Decision(keep={2: True}, old=[0, 1])
    within = compute_status(mesh(), SPEC2, PLANNED, world, pods, at(int(PROGRESS_DEADLINE_SECONDS) - 5),
                            revision="rev2", decision=decision, probe_messages=probe)
    assert conds(within)["Progressing"] == ("True", "RollingOut")
    late = compute_status(mesh(within), SPEC2, PLANNED, world, pods, at(int(PROGRESS_DEADLINE_SECONDS) + 5),
                          revision="rev2", decision=decision, probe_messages=probe)
    assert conds(late)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    text = message(late, "Progressing")
    assert "pipeline 2 not serving 605s after it started" in text and "stage 1" in text
    assert "Readiness probe failed: timeout" in text and "the old pipelines keep serving" in text
    assert conds(late)["Available"][0] == "True" and conds(late)["Degraded"][0] == "False"
    assert [(r, k) for r, k, _ in transition_events(within, late)] == [("ProgressDeadlineExceeded", "Warning")]


def test_a_not_ready_stage_says_why_in_its_kubelets_words_not_that_it_is_running() -> None:
    lost = {**ALL_READY, "code-p0-stage-1": deployment("code-p0-stage-1", 0)}
    pods = [unready_stage_pod("code-p0-stage-1-x", 0, 1)]
    st = compute_status(mesh(), parse_spec({"model": {"name": "org/m"}}), PLANNED, lost, pods, T0)
    assert "is Running" not in message(st, "StagesReady")
    assert "containers with unready status" in message(st, "StagesReady")
    probe = {"code-p0-stage-1-x": "Readiness probe failed: grpc health: NOT_SERVING"}
    st = compute_status(mesh(), parse_spec({"model": {"name": "org/m"}}), PLANNED, lost, pods, T0,
                        probe_messages=probe)
    assert "pod code-p0-stage-1-x: Readiness probe failed: grpc health: NOT_SERVING" in message(st, "StagesReady")


def degraded_status(since: str, reason: str = "CapacityBelowDesired") -> dict:
    return {"conditions": [{"type": "Ready", "status": "False", "reason": "x", "message": "",
                            "lastTransitionTime": since},
                           {"type": "Degraded", "status": "True", "reason": reason, "message": "1/2 pipelines serving",
                            "lastTransitionTime": since}]}


def ready_status(since: str, degraded_since: str = T0) -> dict:
    return {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "serving",
                            "lastTransitionTime": since},
                           {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
                            "lastTransitionTime": degraded_since}]}


def test_a_blink_shorter_than_the_settle_time_announces_nothing() -> None:
    a, key = Announcer(), "ml/code"
    ready = ready_status(T0)
    assert a.events(key, ready, ready, at(5)) == ([], None)  # seeded from the status: Ready was said
    blink = degraded_status(at(10))
    events, again = a.events(key, ready, blink, at(12))
    assert events == [] and again is not None and 0 < again <= SETTLE_SECONDS
    assert a.events(key, blink, ready_status(at(15), at(15)), at(16)) == ([], None)  # back: nothing to say
    # 51 blinks an hour: still nothing
    for n in range(51):
        t = 100 + 60 * n
        assert a.events(key, ready, degraded_status(at(t)), at(t + 2))[0] == []
        assert a.events(key, ready, ready_status(at(t + 5), at(t + 5)), at(t + 6))[0] == []


def test_a_change_that_lasts_is_announced_once_each_way() -> None:
    a, key = Announcer(), "ml/code"
    ready = ready_status(T0)
    a.events(key, ready, ready, at(1))
    lasting = degraded_status(at(10))
    assert a.events(key, ready, lasting, at(11))[0] == []
    events, again = a.events(key, lasting, lasting, at(10 + int(SETTLE_SECONDS)))
    assert [(r, k) for r, k, _ in events] == [("Degraded", "Warning")] and again is None
    assert a.events(key, lasting, lasting, at(100))[0] == []  # said once
    back = ready_status(at(200), at(200))
    assert a.events(key, lasting, back, at(201))[0] == []  # recovered, not yet for long
    assert [r for r, _, _ in a.events(key, back, back, at(200 + int(SETTLE_SECONDS)))[0]] == ["Recovered"]
    # a crash (PodsFailing) is announced at once
    assert [r for r, _, _ in a.events(key, back, degraded_status(at(300), "PodsFailing"), at(300))[0]] == ["Degraded"]


def test_action_events_say_what_the_reconciler_starts_and_drains() -> None:
    base = {**ROUTER, **pipeline(0, True, "rev1"), **pipeline(1, True, "rev1")}
    obs = Observed.of(mesh(), base, [])
    up = action_events(obs, Decision(keep={0: True, 1: True, 2: True}), "rev1", 3)
    assert [(r, k) for r, k, _ in up] == [("ScaledUp", "Normal")] and "pipeline 2 started" in up[0][2]
    down = action_events(obs, Decision(keep={0: True}, drain=[1]), "rev1", 1)
    assert [r for r, _, _ in down] == ["ScaledDown"] and "pipeline 1 draining" in down[0][2]
    roll = action_events(obs, Decision(keep={2: True}, old=[0, 1]), "rev2", 2)
    assert [r for r, _, _ in roll] == ["PipelineStarted"] and "replacing rev1" in roll[0][2]
    with_new = Observed.of(mesh(), {**base, **pipeline(2, True, "rev2")}, [])
    drained = action_events(with_new, Decision(keep={2: True, 3: True}, old=[0], drain=[1]), "rev2", 2)
    assert [r for r, _, _ in drained] == ["PipelineStarted", "PipelineDrained"]
    assert "pipeline 1 (revision rev1, serving) draining: replaced by revision rev2" == drained[1][2]
    # a pipeline drained before (its frontend gone) is not announced again
    gone = {k: v for k, v in base.items() if k != "code-p1-frontend"}
    assert action_events(Observed.of(mesh(), gone, []), Decision(keep={0: True}, drain=[1]), "rev1", 1) == []


def test_how_long_a_pipeline_has_not_served_comes_from_its_frontend_pods_ready_condition() -> None:
    deps = pipeline(0, False, "rev1")
    frontend = pod("code-p0-frontend-x", "frontend", pipeline=0, phase="Running", conditions=[
        {"type": "Ready", "status": "False", "lastTransitionTime": at(100)}])
    p = Observed.of(mesh(), deps, [frontend]).pipelines[0]
    assert p.not_serving_for(at(170)) == 70  # a blink restarts the count: the kubelet moves the time
    terminating = {**frontend, "metadata": {**frontend["metadata"], "deletionTimestamp": at(150)}}
    deps["code-p0-frontend"]["status"]["conditions"] = [
        {"type": "Available", "status": "False", "lastTransitionTime": at(140)}]
    assert Observed.of(mesh(), deps, [terminating]).pipelines[0].not_serving_for(at(170)) == 30  # between pods
    unknown = pod("code-p0-frontend-y", "frontend", pipeline=0)
    unknown["metadata"]["creationTimestamp"] = "not a time"
    assert Observed.of(mesh(), deps, [unknown]).pipelines[0].not_serving_for(at(170)) == 0  # never presumed dead
    assert Observed.of(mesh(), pipeline(0, True, "rev1"), [frontend]).pipelines[0].not_serving_for(at(170)) == 0
