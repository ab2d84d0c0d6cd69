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
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _condition(ctype: str, status: str, reason: str, message: str, generation: int,
               previous: dict[str, dict], now: str) -> dict:
    old = previous.get(ctype)
    changed = old is None or old.get("status") != status
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


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
    meta = mesh["metadata"]
    base, ns = base_name(meta["name"]), meta["namespace"]
    generation = int(meta.get("generation", 0))
    old_status = mesh.get("status") or {}
    previous = {c.get("type"): c for c in old_status.get("conditions") or [] if isinstance(c, dict)}
    plan = outcome.plan

    def cond(ctype: str, status: str, reason: str, message: str) -> dict:
        return _condition(ctype, status, reason, message, generation, previous, now)

    stage_pods: dict[str, list[dict]] = {}
    frontend_pods: list[dict] = []
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LABEL_COMPONENT) == "stage":
            stage_pods.setdefault(labels.get(LABEL_STAGE, ""), []).append(pod)
        elif labels.get(LABEL_COMPONENT) == "frontend":
            frontend_pods.append(pod)

    status: dict = {"observedGeneration": generation}
    conditions = [cond("Planned", outcome.planned_status, outcome.reason, outcome.message)]
    problems = [p for p in (pod_problem(pod) for pod in pods) if p]

    if plan is None:
        status["stages"] = old_status.get("stages") or []
        stages_ok = False
        conditions.append(cond("StagesReady", "Unknown" if not status["stages"] else "False",
                               "NotPlanned", "no plan: " + outcome.message))
    else:
        entries, not_ready = [], []
        for s in plan.stages:
            embedded = plan.embedded_first_stage and s.index == 0
            # The embedded first stage lives and is ready in the frontend's pods (whose /ready needs it SERVING).
            name = frontend_name(base) if embedded else stage_name(base, s.index)
            ready = deployment_ready(deployments.get(name))
            mine = frontend_pods if embedded else stage_pods.get(str(s.index), [])
            newest = _newest(mine)
            entries.append({
                "index": s.index, "layerStart": s.layer_start, "layerEnd": s.layer_end,
                "layers": f"{s.layer_start}:{s.layer_end}", "plannedBytes": s.total_bytes,
                **({"memoryBytes": s.memory_bytes} if s.memory_bytes else {}),
                # No pod: leave the key out. An empty string here made kube-apiserver 1.20's merge patch
                # store null and refuse the whole status (seen, and reproduced, in the cluster tests).
                "ready": ready, **({"pod": newest["metadata"]["name"]} if newest else {}),
                **({"embedded": True} if embedded else {"address": stage_address(base, ns, s.index)}),
            })
            if not ready:
                where = "in the frontend: " if embedded else ""
                not_ready.append(f"stage {s.index} ({where}{_pending_reason(mine)})")
        status["stages"] = entries
        stages_ok = not not_ready
        n = len(plan.stages)
        status["stagesSummary"] = f"{n - len(not_ready)}/{n}"
        if stages_ok:
            conditions.append(cond("StagesReady", "True", "AllStagesReady", f"{n} of {n} stages ready"))
        else:
            conditions.append(cond("StagesReady", "False", "StagesNotReady",
                                   f"{n - len(not_ready)} of {n} stages ready; " + "; ".join(not_ready[:4])))

    front = deployments.get(frontend_name(base))
    front_ok = deployment_ready(front)
    if front_ok:
        conditions.append(cond("FrontendReady", "True", "FrontendReady", "the frontend answers /ready"))
    elif front is None:
        conditions.append(cond("FrontendReady", "False", "NoFrontend", "the frontend Deployment does not exist yet"))
    elif spec is not None and spec.frontend.replicas == 0:
        conditions.append(cond("FrontendReady", "False", "ScaledToZero", "frontend.replicas is 0"))
    else:
        conditions.append(cond("FrontendReady", "False", "FrontendNotReady",
                               "frontend not ready: " + _pending_reason(frontend_pods)))

    ready = outcome.planned_status == "True" and stages_ok and front_ok
    if ready:
        conditions.append(cond("Ready", "True", "Ready", "the OpenAI endpoint is serving"))
    else:
        first = next(c for c in conditions if c["status"] != "True")
        conditions.append(cond("Ready", "False", first["reason"], first["message"]))

    # Readiness lost without a spec change is degradation too; it stays until the mesh is ready again.
    was_ready = previous.get("Ready", {}).get("status") == "True"
    was_lost = previous.get("Degraded", {}).get("reason") == "ReadinessLost"
    same_gen = int(old_status.get("observedGeneration", -1)) == generation
    if problems:
        conditions.append(cond("Degraded", "True", "PodsFailing", "; ".join(problems[:4])))
    elif not ready and plan is not None and same_gen and (was_ready or was_lost):
        conditions.append(cond("Degraded", "True", "ReadinessLost",
                               "the mesh was ready and is not any more: " + conditions[-1]["message"]))
    else:
        conditions.append(cond("Degraded", "False", "AsExpected", "no pod of the mesh is failing"))
    status["conditions"] = conditions

    degraded = conditions[-1]["status"] == "True"
    if outcome.planned_status == "False":
        status["phase"] = "Failed"
    elif outcome.planned_status == "Unknown":
        status["phase"] = "Pending"
    elif degraded:
        status["phase"] = "Degraded"
    else:
        status["phase"] = "Ready" if ready else "Progressing"

    if plan is not None and spec is not None:
        status["planHash"] = plan.hash
        status["speculative"] = speculative_status(plan.speculative, observed_speculative)
        status["endpoint"] = endpoint_url(base, ns, spec)
    else:
        for key in ("planHash", "speculative", "endpoint", "stagesSummary"):
            if key in old_status:
                status[key] = old_status[key]
    status["frontendReplicas"] = int(((front or {}).get("status") or {}).get("replicas", 0))
    status["frontendSelector"] = ",".join(f"{k}={v}" for k, v in frontend_selector(base).items())
    return status
