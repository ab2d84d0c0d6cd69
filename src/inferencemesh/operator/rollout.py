"""Serving capacity and the rollout, as the status reports them: which pipelines serve, which start
for the first time, which stopped serving and why, and the Available and Progressing conditions.

A pipeline serves while its frontend is ready (observe.py); one that never served yet is starting
(until PROGRESS_DEADLINE_SECONDS after its creation: then it is stuck, and a rollout waiting on it
stops); one that served and stopped has lost its place (whatever the reason: a blink, a crash).
"Served before" is read from the previous status.pipelines entry, so it survives an operator restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from inferencemesh.operator.names import LABEL_COMPONENT, LABEL_STAGE
from inferencemesh.operator.observe import (
    Observed,
    PipelineObserved,
    RestartWindow,
    deployment_ready,
    not_ready_reason,
    seconds_between,
)
from inferencemesh.operator.pipelines import PROGRESS_DEADLINE_SECONDS, Decision


class Verdict(NamedTuple):
    """One condition's status, reason and message."""

    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def served_before(previous: dict | None) -> bool:
    """Whether a pipeline's previous status entry says it served (Ready, or Degraded after serving)."""
    if not previous:
        return False
    return previous.get("ready") is True or previous.get("state") in ("Ready", "Degraded")


def _newest(pods: list[dict]) -> dict | None:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


def why_not_serving(p: PipelineObserved, probe_messages: dict[str, str] | None = None) -> str:
    """Why a pipeline's frontend is not ready: its first stage that is not (its pod's own account:
    the readiness probe's failure, a waiting container), else its frontend pod's."""
    if not p.has_frontend:
        return "its frontend is gone (draining)"
    stages = sorted((d for d in p.deployments.values() if (d["metadata"].get("labels") or {}).get(LABEL_COMPONENT)
                     == "stage" and not deployment_ready(d)),
                    key=lambda d: int((d["metadata"].get("labels") or {}).get(LABEL_STAGE, "0") or 0))
    for dep in stages:
        stage = (dep["metadata"].get("labels") or {}).get(LABEL_STAGE, "?")
        pod = _newest([q for q in p.stage_pods.get(stage, []) if not q["metadata"].get("deletionTimestamp")])
        return f"stage {stage}: " + (not_ready_reason(pod, probe_messages) if pod else "no pod yet")
    pod = _newest([q for q in p.frontend_pods if not q["metadata"].get("deletionTimestamp")])
    return "frontend: " + (not_ready_reason(pod, probe_messages) if pod else "no pod yet")


@dataclass(frozen=True)
class Capacity:
    """The pipelines by what they serve. serving: any revision, with a frontend, not Failed;
    starting: current ones that never served, within the deadline; stuck: past it (index -> seconds);
    lost: the others that do not serve; why: why each that does not serve does not."""

    replicas: int
    revision: str
    serving: list[int]
    current_serving: list[int]
    starting: list[int]
    stuck: dict[int, float]
    lost: list[int]
    why: dict[int, str]

    @property
    def shortfall(self) -> int:
        """Pipelines missing from spec.replicas beyond those starting for the first time."""
        return self.replicas - len(self.serving) - len(self.starting)


def capacity(obs: Observed, decision: Decision, windows: dict[int, RestartWindow], previous: dict[int, dict],
             replicas: int, revision: str, now: str, probe_messages: dict[str, str] | None = None) -> Capacity:
    running = {i for i, on in decision.keep.items() if on and not (i in windows and windows[i].failed)}
    fronted = sorted(running | set(decision.old))
    serving, current_serving, starting, lost = [], [], [], []
    stuck: dict[int, float] = {}
    why: dict[int, str] = {}
    for i in fronted:
        p = obs.pipelines.get(i) or PipelineObserved(i, "", {}, [], {})
        if p.serving:
            serving.append(i)
            current_serving += [i] if i in running else []
            continue
        why[i] = why_not_serving(p, probe_messages) if p.deployments else "not created yet"
        age = seconds_between(p.created, now) if p.created else 0.0
        if i in running and not served_before(previous.get(i)):
            if age != float("inf") and age > PROGRESS_DEADLINE_SECONDS:
                stuck[i] = age
            else:
                starting.append(i)
        else:
            lost.append(i)
    return Capacity(replicas, revision, serving, current_serving, starting, stuck, lost, why)


def available_condition(cap: Capacity) -> Verdict:
    if cap.replicas == 0:
        return Verdict("False", "ScaledToZero", "spec.replicas is 0")
    text = f"{len(cap.serving)}/{cap.replicas} pipelines serving"
    if len(cap.serving) >= cap.replicas:
        return Verdict("True", "PipelinesServing", text)
    first = next(iter(cap.lost + list(cap.stuck) + cap.starting), None)
    return Verdict("False", "PipelinesUnavailable", text + (f"; pipeline {first}: {cap.why[first]}" if first is not None
                                                            and first in cap.why else ""))


def capacity_problem(cap: Capacity) -> str | None:
    """What Degraded says when fewer pipelines serve than asked, beyond those starting; else None."""
    if cap.replicas == 0 or cap.shortfall <= 0:
        return None
    first = next(iter(cap.lost + list(cap.stuck)), None)
    reason = f": pipeline {first}: {cap.why[first]}" if first is not None and first in cap.why else ""
    return f"{len(cap.serving)}/{cap.replicas} pipelines serving{reason}"


def progressing_condition(cap: Capacity, obs: Observed, decision: Decision) -> Verdict:
    """Where the rollout to cap.revision stands (see the module docstring of status.py)."""
    rev = cap.revision
    old_draining = [i for i in decision.drain if i in obs.pipelines and obs.pipelines[i].revision != rev]
    current_draining = [i for i in decision.drain if i in obs.pipelines and obs.pipelines[i].revision == rev]
    if cap.stuck:
        index, age = next(iter(cap.stuck.items()))
        keep = "; the old pipelines keep serving" if decision.old else ""
        return Verdict("False", "ProgressDeadlineExceeded",
                       f"revision {rev}: pipeline {index} not serving {age:.0f}s after it started "
                       f"(deadline {PROGRESS_DEADLINE_SECONDS:.0f}s): {cap.why.get(index, '')}{keep}")
    replaced = min(len(cap.current_serving), cap.replicas)
    if decision.old or old_draining:
        tail = f", {len(old_draining)} old draining" if old_draining else ""
        return Verdict("True", "RollingOut", f"rolling to revision {rev}: {replaced}/{cap.replicas} pipelines "
                                             f"replaced{tail}")
    if cap.starting:
        return Verdict("True", "PipelinesStarting", f"revision {rev}: {len(cap.current_serving)}/{cap.replicas} "
                                                    f"pipelines serving, {len(cap.starting)} starting")
    if current_draining:
        return Verdict("True", "ScalingDown", f"revision {rev}: scaling down to {cap.replicas}, "
                                              f"{len(current_draining)} draining")
    return Verdict("False", "Complete", f"revision {rev}: {cap.replicas} pipelines, none being replaced")
