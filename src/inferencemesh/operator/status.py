"""Pure status computation: plan outcome + observed children -> the InferenceMesh status.

Conditions (each with reason and message):
  Planned        True once layer ranges exist; False for an impossible spec (terminal until edited);
                 Unknown while the model cannot be read yet (retried).
  StagesReady    every stage Deployment has its up-to-date pod ready (a first stage embedded in the
                 frontend is ready when the frontend Deployment is: it has no Deployment of its own).
  FrontendReady  the frontend Deployment has its replicas ready (its /ready needs every stage SERVING).
  Ready          Planned and StagesReady and FrontendReady.
  Degraded       a pod of the mesh is failing (crash loop, image pull, OOM, failed), or readiness was
                 lost without a spec change; clears by itself when the pods are back.
lastTransitionTime only moves when a condition's status changes, so recomputing an unchanged
world yields an identical status and the operator writes nothing.

Each condition is decided by one function (planned_condition, stages_condition, frontend_condition,
ready_condition, degraded_condition) from an Observed view of the children; compute_status puts
them together with the phase and the other fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from inferencemesh.operator.names import (
    LABEL_COMPONENT,
    LABEL_STAGE,
    base_name,
    endpoint_url,
    frontend_name,
    frontend_selector,
    stage_address,
    stage_name,
)
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.spec import MeshSpec
from inferencemesh.speculation import SpeculativeChoice

CONDITION_TYPES = ("Planned", "StagesReady", "FrontendReady", "Ready", "Degraded")
FAILING_WAIT_REASONS = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
    "CreateContainerError", "InvalidImageName", "RunContainerError",
}


@dataclass(frozen=True)
class PlanOutcome:
    plan: Plan | None = None
    planned_status: str = "True"  # "True" | "False" | "Unknown"
    reason: str = "Planned"
    message: str = ""


def deployment_ready(dep: dict | None) -> bool:
    """Up to date and every desired replica ready (0 desired counts as not ready: nothing serves)."""
    if not dep:
        return False
    want = int(dep.get("spec", {}).get("replicas", 1))
    st = dep.get("status") or {}
    return (
        want > 0
        and int(st.get("observedGeneration", 0)) >= int(dep["metadata"].get("generation", 0))
        and int(st.get("updatedReplicas", 0)) >= want
        and int(st.get("readyReplicas", 0)) >= want
    )


def pod_problem(pod: dict) -> str | None:
    """Why a pod is failing, or None: what Degraded reports."""
    st = pod.get("status") or {}
    name = pod["metadata"]["name"]
    if st.get("phase") == "Failed":
        return f"pod {name} failed: {st.get('reason') or st.get('message') or 'Failed'}"
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_WAIT_REASONS:
            return f"pod {name}: {waiting['reason']} (restarts {cs.get('restartCount', 0)})"
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if last.get("reason") == "OOMKilled" and not cs.get("ready"):
            return f"pod {name}: OOMKilled (restarts {cs.get('restartCount', 0)})"
    return None


def _pending_reason(pods: list[dict]) -> str:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"pod {pod['metadata']['name']} unschedulable: {c.get('message') or c.get('reason')}"
    if pods:
        return f"pod {pods[0]['metadata']['name']} is {(pods[0].get('status') or {}).get('phase', 'Pending')}"
    return "no pod yet"


def _newest(pods: list[dict]) -> dict | None:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


class Verdict(NamedTuple):
    """One condition's status, reason and message."""

    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def _condition(ctype: str, verdict: Verdict, generation: int, previous: dict[str, dict], now: str) -> dict:
    """A condition object; its lastTransitionTime moves only when its status does."""
    old = previous.get(ctype)
    changed = old is None or old.get("status") != verdict.status
    return {
        "type": ctype,
        "status": verdict.status,
        "reason": verdict.reason,
        "message": verdict.message,
        "lastTransitionTime": now if changed or old is None else old.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


@dataclass(frozen=True)
class Observed:
    """What a status is computed from: the plan outcome and the mesh's children, by role."""

    base: str
    namespace: str
    spec: MeshSpec | None
    outcome: PlanOutcome
    deployments: dict[str, dict]  # by name
    stage_pods: dict[str, list[dict]]  # by stage index (the label's text)
    frontend_pods: list[dict]
    problems: list[str]  # pod_problem of every pod of the mesh

    @classmethod
    def of(cls, mesh: dict, spec: MeshSpec | None, outcome: PlanOutcome, deployments: dict[str, dict],
           pods: list[dict]) -> Observed:
        stage_pods: dict[str, list[dict]] = {}
        frontend_pods: list[dict] = []
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            if labels.get(LABEL_COMPONENT) == "stage":
                stage_pods.setdefault(labels.get(LABEL_STAGE, ""), []).append(pod)
            elif labels.get(LABEL_COMPONENT) == "frontend":
                frontend_pods.append(pod)
        problems = [p for p in (pod_problem(pod) for pod in pods) if p]
        meta = mesh["metadata"]
        return cls(base_name(meta["name"]), meta["namespace"], spec, outcome, deployments, stage_pods,
                   frontend_pods, problems)

    @property
    def frontend(self) -> dict | None:
        return self.deployments.get(frontend_name(self.base))


def stage_entries(obs: Observed, plan: Plan) -> tuple[list[dict], list[str]]:
    """status.stages for a plan, and a short account of each stage that is not ready."""
    entries, not_ready = [], []
    for s in plan.stages:
        embedded = plan.embedded_first_stage and s.index == 0
        # The embedded first stage lives and is ready in the frontend's pods (whose /ready needs it SERVING).
        name = frontend_name(obs.base) if embedded else stage_name(obs.base, s.index)
        ready = deployment_ready(obs.deployments.get(name))
        mine = obs.frontend_pods if embedded else obs.stage_pods.get(str(s.index), [])
        newest = _newest(mine)
        entries.append({
            "index": s.index, "layerStart": s.layer_start, "layerEnd": s.layer_end,
            "layers": f"{s.layer_start}:{s.layer_end}", "plannedBytes": s.total_bytes,
            **({"memoryBytes": s.memory_bytes} if s.memory_bytes else {}),
            # No pod: leave the key out. An empty string here made kube-apiserver 1.20's merge patch
            # store null and refuse the whole status (seen, and reproduced, in the cluster tests).
            "ready": ready, **({"pod": newest["metadata"]["name"]} if newest else {}),
            **({"embedded": True} if embedded else {"address": stage_address(obs.base, obs.namespace, s.index)}),
        })
        if not ready:
            where = "in the frontend: " if embedded else ""
            not_ready.append(f"stage {s.index} ({where}{_pending_reason(mine)})")
    return entries, not_ready


def planned_condition(outcome: PlanOutcome) -> Verdict:
    return Verdict(outcome.planned_status, outcome.reason, outcome.message)


def stages_condition(outcome: PlanOutcome, entries: list[dict], not_ready: list[str]) -> Verdict:
    """entries: status.stages (without a plan, the last known ones)."""
    if outcome.plan is None:
        return Verdict("Unknown" if not entries else "False", "NotPlanned", "no plan: " + outcome.message)
    n = len(outcome.plan.stages)
    if not not_ready:
        return Verdict("True", "AllStagesReady", f"{n} of {n} stages ready")
    return Verdict("False", "StagesNotReady", f"{n - len(not_ready)} of {n} stages ready; " + "; ".join(not_ready[:4]))


def frontend_condition(obs: Observed) -> Verdict:
    if deployment_ready(obs.frontend):
        return Verdict("True", "FrontendReady", "the frontend answers /ready")
    if obs.frontend is None:
        return Verdict("False", "NoFrontend", "the frontend Deployment does not exist yet")
    if obs.spec is not None and obs.spec.frontend.replicas == 0:
        return Verdict("False", "ScaledToZero", "frontend.replicas is 0")
    return Verdict("False", "FrontendNotReady", "frontend not ready: " + _pending_reason(obs.frontend_pods))


def ready_condition(planned: Verdict, stages: Verdict, frontend: Verdict) -> Verdict:
    """Ready when the other three are; else the first that is not says why."""
    first = next((v for v in (planned, stages, frontend) if v.status != "True"), None)
    if first is None:
        return Verdict("True", "Ready", "the OpenAI endpoint is serving")
    return Verdict("False", first.reason, first.message)


def degraded_condition(obs: Observed, ready: Verdict, previous: dict[str, dict], same_generation: bool) -> Verdict:
    """A pod failing, or readiness lost without a spec change (kept until the mesh is ready again)."""
    if obs.problems:
        return Verdict("True", "PodsFailing", "; ".join(obs.problems[:4]))
    was_ready = previous.get("Ready", {}).get("status") == "True"
    was_lost = previous.get("Degraded", {}).get("reason") == "ReadinessLost"
    if ready.status != "True" and obs.outcome.plan is not None and same_generation and (was_ready or was_lost):
        return Verdict("True", "ReadinessLost", "the mesh was ready and is not any more: " + ready.message)
    return Verdict("False", "AsExpected", "no pod of the mesh is failing")


def phase_of(outcome: PlanOutcome, ready: Verdict, degraded: Verdict) -> str:
    if outcome.planned_status == "False":
        return "Failed"
    if outcome.planned_status == "Unknown":
        return "Pending"
    if degraded.status == "True":
        return "Degraded"
    return "Ready" if ready.status == "True" else "Progressing"


def speculative_status(planned: SpeculativeChoice, observed: tuple[str, str] | None) -> dict:
    """What the frontend runs: its own report when there is one, else the plan's prediction."""
    if observed is None:
        return {"strategy": planned.strategy, "reason": planned.reason, "message": planned.message}
    strategy, reason = observed
    if (strategy, reason) == (planned.strategy, planned.reason):
        return {"strategy": strategy, "reason": reason, "message": planned.message + " (the frontend runs it)"}
    return {"strategy": strategy, "reason": reason,
            "message": f"the frontend runs {strategy} ({reason}); planned was {planned.strategy}: {planned.message}"}


def compute_status(mesh: dict, spec: MeshSpec | None, outcome: PlanOutcome, deployments: dict[str, dict],
                   pods: list[dict], now: str, observed_speculative: tuple[str, str] | None = None) -> dict:
    """The whole status object. deployments: by name; pods: every pod carrying the mesh label;
    spec: None when it does not parse (then outcome says why and there is no plan);
    observed_speculative: the (strategy, reason) the running frontend reports, if it could be read."""
    obs = Observed.of(mesh, spec, outcome, deployments, pods)
    generation = int(mesh["metadata"].get("generation", 0))
    old_status = mesh.get("status") or {}
    previous = {str(c.get("type")): c for c in old_status.get("conditions") or [] if isinstance(c, dict)}
    plan = outcome.plan

    entries, not_ready = stage_entries(obs, plan) if plan is not None else (old_status.get("stages") or [], [])
    status: dict = {"observedGeneration": generation, "stages": entries}
    if plan is not None:
        status["stagesSummary"] = f"{len(plan.stages) - len(not_ready)}/{len(plan.stages)}"
    planned = planned_condition(outcome)
    stages = stages_condition(outcome, entries, not_ready)
    frontend = frontend_condition(obs)
    ready = ready_condition(planned, stages, frontend)
    same_generation = int(old_status.get("observedGeneration", -1)) == generation
    degraded = degraded_condition(obs, ready, previous, same_generation)
    verdicts = dict(zip(CONDITION_TYPES, (planned, stages, frontend, ready, degraded), strict=True))
    status["conditions"] = [_condition(t, v, generation, previous, now) for t, v in verdicts.items()]
    status["phase"] = phase_of(outcome, ready, degraded)

    if plan is not None and spec is not None:
        status["planHash"] = plan.hash
        status["speculative"] = speculative_status(plan.speculative, observed_speculative)
        status["endpoint"] = endpoint_url(obs.base, obs.namespace, spec)
    else:
        for key in ("planHash", "speculative", "endpoint", "stagesSummary"):
            if key in old_status:
                status[key] = old_status[key]
    status["frontendReplicas"] = int(((obs.frontend or {}).get("status") or {}).get("replicas", 0))
    status["frontendSelector"] = ",".join(f"{k}={v}" for k, v in frontend_selector(obs.base).items())
    return status
